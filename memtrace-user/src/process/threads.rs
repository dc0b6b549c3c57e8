//! memtrace's own threads and how urgent they are: the exec watcher must read a new program's
//! files before a short-lived process is gone; building unwind tables can wait.

/// How urgent the calling thread's work is.
#[derive(Debug, Clone, Copy)]
pub enum Urgency {
    /// Races the traced processes (the exec watcher).
    Racing,
    /// Bulk work that may lag (building unwind tables).
    Background,
}

/// Sets the calling thread's nice value for `urgency`. Best effort: without the privilege to raise
/// it, the thread keeps the default.
pub fn set_urgency(urgency: Urgency) {
    let nice = match urgency {
        Urgency::Racing => -10,
        Urgency::Background => 10,
    };
    // SAFETY: gettid has no preconditions; setpriority takes plain integers and changes only the
    // calling thread (a tid names one thread for PRIO_PROCESS on Linux).
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice);
    }
}
