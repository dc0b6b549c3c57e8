//! Property tests: the note parser, the argument-spec parser and the `--usdt` parser never panic,
//! whatever bytes or text they get, and what they accept is well formed.

use proptest::prelude::*;

use super::{args, notes, request::UsdtRequest};

/// Text near the argument-spec grammar, so that the parser's deeper paths are reached often.
fn spec_like() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just("-".to_owned()),
            Just("@".to_owned()),
            Just("%".to_owned()),
            Just("$".to_owned()),
            Just("(".to_owned()),
            Just(")".to_owned()),
            Just(",".to_owned()),
            Just("+".to_owned()),
            Just("0x".to_owned()),
            Just(" ".to_owned()),
            "[0-9]{1,20}",
            "(r|e)?(ax|bx|cx|dx|si|di|bp|sp|ip)",
            "r(8|9|1[0-5])(d|w|b|l)?",
            "[a-z_.]{1,8}",
        ],
        0..12,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn note_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        for note in notes::parse_notes(&bytes) {
            prop_assert!(!note.provider.is_empty() && !note.name.is_empty());
        }
        let _ = notes::parse_elf(&bytes);
    }

    #[test]
    fn note_parser_survives_corrupted_notes(
        address in any::<u64>(),
        strings in proptest::collection::vec("[ -~]{0,12}", 0..4),
        corruption in proptest::collection::vec((any::<u16>(), any::<u8>()), 0..6),
        cut in any::<u16>(),
    ) {
        let strings: Vec<&str> = strings.iter().map(String::as_str).collect();
        let mut bytes = notes::tests::note(address, 0, 0, &strings);
        for (at, value) in corruption {
            if !bytes.is_empty() {
                let at = at as usize % bytes.len();
                bytes[at] = value;
            }
        }
        let cut = cut as usize % (bytes.len() + 1);
        let _ = notes::parse_notes(&bytes[..cut]);
    }

    #[test]
    fn arg_parser_never_panics_on_any_text(text in "\\PC{0,40}") {
        let _ = args::parse_all(&text);
    }

    #[test]
    fn arg_parser_accepts_only_sane_specs(text in spec_like()) {
        for spec in text.split_ascii_whitespace() {
            if let Ok(parsed) = args::parse(spec) {
                prop_assert!(matches!(parsed.size, 1 | 2 | 4 | 8), "{spec}: {parsed:?}");
                let no_symbols = |_: &str| Some(0x1000);
                let site = args::SiteContext { address: 0x2000, symbol_address: &no_symbols };
                let arg = parsed.to_bpf(&site).unwrap();
                prop_assert!(arg.register_offset <= 160 && arg.index_offset <= 160);
            }
        }
    }

    #[test]
    fn usdt_option_parser_never_panics(text in "\\PC{0,40}") {
        if let Ok(request) = UsdtRequest::parse(&text) {
            prop_assert!(!request.provider.is_empty() && !request.name.is_empty());
            prop_assert_eq!(request.label, text);
        }
    }
}
