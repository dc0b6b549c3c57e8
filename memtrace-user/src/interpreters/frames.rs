//! Interpreter frames put where they ran among the native frames.
//!
//! The kernel stores a stack's interpreter frames after its native ones, innermost first, each
//! run of them that one native call of the interpreter's loop ran marked at its outermost frame
//! (its entry flag). So the frames are written before each native frame of the loop in turn, up to
//! the next entry frame, as `py-spy --native` and `memray --native` show them. Frames past the last
//! loop frame the native walk reached (it was cut) go at the end.

use std::sync::Arc;

use memtrace_common::StackFrame;

use crate::model::frame::Frame;

/// The native frames with the interpreter's before each of its loop's frames in turn.
pub fn place(
    native: Vec<Arc<Frame>>,
    interpreted: Vec<(Arc<Frame>, bool)>,
    loop_functions: &[&str],
) -> Vec<Arc<Frame>> {
    if interpreted.is_empty() {
        return native;
    }
    let mut pending = interpreted.into_iter();
    let mut frames = Vec::with_capacity(native.len() + pending.len());
    for frame in native {
        if frame.function.as_deref().is_some_and(|name| loop_functions.contains(&name)) {
            for (interpreted, entry) in pending.by_ref() {
                frames.push(interpreted);
                if entry {
                    break;
                }
            }
        }
        frames.push(frame);
    }
    frames.extend(pending.map(|(interpreted, _)| interpreted));
    frames
}

/// A stored interpreter frame's code, entry flag, kind, fingerprint and instruction or line
/// (`FRAME_PYTHON`, `FRAME_PERL`).
pub fn stored_frame(frame: &StackFrame) -> (u64, bool, u8, u64, u64) {
    let id = &frame.build_id;
    let word = |at: usize| u64::from_le_bytes(id[at..at + 8].try_into().expect("8 bytes"));
    (word(0), id[8] != 0, id[9], word(12), frame.offset_or_ip)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interpreters::{perl::LANGUAGE as PERL, python::LANGUAGE as PYTHON};

    fn frame(name: &str, interpreter: Option<&str>) -> Arc<Frame> {
        Arc::new(Frame {
            function: Some(name.into()),
            file: interpreter.map(|_| "app.py".into()),
            line: interpreter.map(|_| 1),
            module: "python3".into(),
            offset: 0,
            interpreter: interpreter.map(Into::into),
        })
    }

    #[test]
    fn interpreter_frames_go_before_the_loop_frame_they_ran_in() {
        // make_cache called from <module> in one eval call; <module> entered from C (a callback
        // of map(), say) that handler's eval call made.
        let python = |name: &str, entry| (frame(name, Some("python")), entry);
        let interpreted =
            vec![python("make_cache", false), python("<module>", true), python("handler", true)];
        let natives =
            ["PyByteArray_Resize", PYTHON.loop_functions[0], "map_next", PYTHON.loop_functions[0], "main"]
                .map(|name| frame(name, None));
        let frames = place(natives.to_vec(), interpreted, PYTHON.loop_functions);
        let shown: Vec<String> = frames.iter().map(|f| f.name()).collect();
        assert_eq!(
            shown,
            [
                "PyByteArray_Resize",
                "make_cache (app.py:1)",
                "<module> (app.py:1)",
                PYTHON.loop_functions[0],
                "map_next",
                "handler (app.py:1)",
                PYTHON.loop_functions[0],
                "main"
            ]
        );
    }

    #[test]
    fn frames_past_the_native_walk_go_at_the_end() {
        let interpreted = vec![(frame("main::make_cache", Some("perl")), false)];
        let frames = place(vec![frame("Perl_sv_grow", None)], interpreted, PERL.loop_functions);
        let shown: Vec<String> = frames.iter().map(|f| f.name()).collect();
        assert_eq!(shown, ["Perl_sv_grow", "main::make_cache (app.py:1)"]);
    }
}
