//! Where a C library keeps each thread's thread-specific data (`pthread_getspecific`), read from
//! what glibc exports for libthread_db: each `_thread_db_<struct>_<field>` symbol is three u32s
//! (the field's size in bits, its count of elements, its byte offset), no debug symbols needed.
//! Perl keeps each thread's interpreter under such a key (`PL_thr_key`). Offsets are counted from
//! the thread pointer, which is the `struct pthread` on x86-64 and points just past it on arm64
//! (its size is `_thread_db_sizeof_pthread`).

use memtrace_common::ThreadKeys;

use super::elf::ElfObject;

/// The thread-specific keys of the C library `elf`, if it describes them (glibc does).
pub fn thread_keys(elf: &ElfObject<'_>) -> Option<ThreadKeys> {
    let word = |address: u64| Some(u32::from_le_bytes(elf.bytes_at(address, 4)?.try_into().ok()?));
    let descriptor = |name: &str| -> Option<[u32; 3]> {
        let at = elf.defined_data(name)?;
        Some([word(at)?, word(at + 4)?, word(at + 8)?])
    };
    // `struct pthread.specific`: an array of pointers to blocks of key records.
    let [_, _, specific] = descriptor("_thread_db_pthread_specific")?;
    let below_thread_pointer = match elf.architecture() {
        object::Architecture::Aarch64 => word(elf.defined_data("_thread_db_sizeof_pthread")?)?,
        _ => 0,
    };
    let specific = i64::from(specific) - i64::from(below_thread_pointer);
    // A block: `keys_per_block` records (`struct pthread_key_data`) of `bits / 8` bytes each.
    let [record_bits, keys_per_block, _] = descriptor("_thread_db_pthread_key_data_level2_data")?;
    let [_, _, data] = descriptor("_thread_db_pthread_key_data_data")?;
    let keys = ThreadKeys {
        specific: i32::try_from(specific).ok()?,
        keys_per_block,
        record_size: record_bits / 8,
        data,
    };
    (keys.keys_per_block > 0 && keys.record_size > keys.data).then_some(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian 12's glibc (2.36): `pthread_getspecific` adds 0x310 + 16 * key to the thread
    /// pointer for a key below 32 (its first block, `specific_1stblock`, lies just before
    /// `specific`, 32 records of 16 bytes: 784 + 512 = 1296) and reads the record's second word.
    #[test]
    fn debians_glibc_describes_its_thread_keys() {
        let data = std::fs::read("/lib/x86_64-linux-gnu/libc.so.6").expect("Debian 12's libc");
        let elf = ElfObject::parse(&data).unwrap();
        let keys = thread_keys(&elf).expect("glibc exports its _thread_db descriptors");
        assert_eq!(keys, ThreadKeys { specific: 1296, keys_per_block: 32, record_size: 16, data: 8 });
    }

    /// Debian 12's arm64 glibc (the cross toolchain's, 2.36): `struct pthread` is 1856 bytes
    /// (`_thread_db_sizeof_pthread`) and lies just below the thread pointer; its `specific` is at
    /// 784 in it, so at 784 - 1856 = -1072 from the pointer. `pthread_getspecific` says the same:
    /// for a key from 32 up it reads `specific[key >> 5]` at `tpidr_el0 + (key >> 5) * 8 - 0x440
    /// + 16` (-1088 + 16 = -1072); for one below 32, record `key` of the first block at
    /// `tpidr_el0 + 16 * key - 0x630` (-1584 = -1072 - 32 * 16: the block lies just before
    /// `specific`), its value the record's second word.
    #[test]
    fn debians_arm64_glibc_describes_its_thread_keys_below_the_thread_pointer() {
        let Ok(data) = std::fs::read("/usr/aarch64-linux-gnu/lib/libc.so.6") else {
            panic!("no arm64 glibc: install libc6-arm64-cross (`cargo xtask setup` does)");
        };
        let elf = ElfObject::parse(&data).unwrap();
        let keys = thread_keys(&elf).expect("arm64 glibc exports its _thread_db descriptors");
        assert_eq!(keys, ThreadKeys { specific: -1072, keys_per_block: 32, record_size: 16, data: 8 });
    }

    /// A file that is no C library has none.
    #[test]
    fn perl_describes_no_thread_keys() {
        let data = std::fs::read("/usr/bin/perl").unwrap();
        assert_eq!(thread_keys(&ElfObject::parse(&data).unwrap()), None);
    }
}
