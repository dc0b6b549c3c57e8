//! x86-64 USDT argument specs, as gcc and clang write them into `.note.stapsdt`: `8@%rdi`, `-4@%eax`,
//! `4@$5`, `-4@-12(%rbp)`, `8@16(%rax,%rbx,8)`, `-4@counter(%rip)`. Each is `[-]SIZE@OPERAND` in AT&T
//! syntax; a minus means the value is signed. arm64's operands are arm64_args.rs's.

use std::fmt;

use memtrace_common::{usdt_location, UsdtArg};

pub use super::operand::{Displacement, Location, Register};

/// Offsets of the 64-bit registers in `struct pt_regs` (arch/x86/include/asm/ptrace.h).
const PT_REGS: [(&str, u16); 17] = [
    ("r15", 0),
    ("r14", 8),
    ("r13", 16),
    ("r12", 24),
    ("rbp", 32),
    ("rbx", 40),
    ("r11", 48),
    ("r10", 56),
    ("r9", 64),
    ("r8", 72),
    ("rax", 80),
    ("rcx", 88),
    ("rdx", 96),
    ("rsi", 104),
    ("rdi", 112),
    ("rip", 128),
    ("rsp", 152),
];

/// Every name of every width: (name, 64-bit register, high byte).
const REGISTER_NAMES: &[(&str, &str, bool)] = &[
    ("rax", "rax", false),
    ("eax", "rax", false),
    ("ax", "rax", false),
    ("al", "rax", false),
    ("ah", "rax", true),
    ("rbx", "rbx", false),
    ("ebx", "rbx", false),
    ("bx", "rbx", false),
    ("bl", "rbx", false),
    ("bh", "rbx", true),
    ("rcx", "rcx", false),
    ("ecx", "rcx", false),
    ("cx", "rcx", false),
    ("cl", "rcx", false),
    ("ch", "rcx", true),
    ("rdx", "rdx", false),
    ("edx", "rdx", false),
    ("dx", "rdx", false),
    ("dl", "rdx", false),
    ("dh", "rdx", true),
    ("rsi", "rsi", false),
    ("esi", "rsi", false),
    ("si", "rsi", false),
    ("sil", "rsi", false),
    ("rdi", "rdi", false),
    ("edi", "rdi", false),
    ("di", "rdi", false),
    ("dil", "rdi", false),
    ("rbp", "rbp", false),
    ("ebp", "rbp", false),
    ("bp", "rbp", false),
    ("bpl", "rbp", false),
    ("rsp", "rsp", false),
    ("esp", "rsp", false),
    ("sp", "rsp", false),
    ("spl", "rsp", false),
    ("rip", "rip", false),
    ("eip", "rip", false),
];

impl Register {
    /// A register by its AT&T name without `%`: rax, eax, ax, al, ah, r8, r8d, r8w, r8b, r8l...
    pub fn named(name: &str) -> Option<Self> {
        let (full, high) = REGISTER_NAMES
            .iter()
            .find(|(alias, _, _)| *alias == name)
            .map(|&(_, full, high)| (full, high))
            .or_else(|| numbered_register(name))?;
        let &(full_name, offset) = PT_REGS.iter().find(|(n, _)| *n == full)?;
        Some(Self { name: full_name, offset, shift: if high { 8 } else { 0 } })
    }

    fn is_instruction_pointer(&self) -> bool {
        self.name == "rip"
    }
}

/// r8..r15 with an optional width suffix: d (32), w (16), b or l (8).
fn numbered_register(name: &str) -> Option<(&'static str, bool)> {
    let digits = name.strip_prefix('r')?;
    let digits = digits.trim_end_matches(['d', 'w', 'b', 'l']);
    let suffix = &name[1 + digits.len()..];
    if suffix.len() > 1 {
        return None;
    }
    let full = match digits {
        "8" => "r8",
        "9" => "r9",
        "10" => "r10",
        "11" => "r11",
        "12" => "r12",
        "13" => "r13",
        "14" => "r14",
        "15" => "r15",
        _ => return None,
    };
    Some((full, false))
}

/// One parsed argument spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgSpec {
    /// Size of the value in bytes: 1, 2, 4 or 8.
    pub size: u8,
    pub signed: bool,
    pub location: Location,
    /// The spec as written in the note.
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgError {
    pub spec: String,
    pub reason: String,
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "argument spec `{}`: {}", self.spec, self.reason)
    }
}

impl std::error::Error for ArgError {}

/// Parses a note's whole argument string: specs separated by spaces.
pub fn parse_all(text: &str) -> Result<Vec<ArgSpec>, ArgError> {
    text.split_ascii_whitespace().map(parse).collect()
}

/// The assembler syntax of argument specs: that of the architecture memtrace runs on, as it traces
/// processes of its own architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    X86_64,
    Aarch64,
}

impl Dialect {
    pub const HOST: Dialect = if cfg!(target_arch = "aarch64") { Dialect::Aarch64 } else { Dialect::X86_64 };
}

/// Parses one spec such as `-4@-12(%rbp)` (arm64: `-4@[sp, 12]`), in the host's dialect.
pub fn parse(spec: &str) -> Result<ArgSpec, ArgError> {
    parse_in(spec, Dialect::HOST)
}

/// Parses one spec in `dialect`.
pub fn parse_in(spec: &str, dialect: Dialect) -> Result<ArgSpec, ArgError> {
    let fail = |reason: &str| ArgError { spec: spec.to_owned(), reason: reason.to_owned() };
    // The size is optional in the oldest notes; the value is then a full register's width.
    let (size, signed, operand) = match spec.split_once('@') {
        Some((size_text, operand)) if !size_text.is_empty() && !operand.is_empty() => {
            let (signed, digits) = match size_text.strip_prefix('-') {
                Some(digits) => (true, digits),
                None => (false, size_text),
            };
            if digits.ends_with('f') {
                return Err(fail("floating-point arguments are not supported (they live in SSE registers)"));
            }
            let size = match digits {
                "1" => 1,
                "2" => 2,
                "4" => 4,
                "8" => 8,
                _ => return Err(fail("the size must be 1, 2, 4 or 8 bytes")),
            };
            (size, signed, operand)
        }
        Some(_) => return Err(fail("expected SIZE@OPERAND")),
        None => (8, false, spec),
    };
    let location = match dialect {
        Dialect::X86_64 => parse_operand(operand),
        Dialect::Aarch64 => super::arm64_args::parse_operand(operand, parse_integer),
    };
    let location = location.map_err(|reason| fail(&reason))?;
    Ok(ArgSpec { size, signed, location, text: spec.to_owned() })
}

fn parse_operand(operand: &str) -> Result<Location, String> {
    if let Some(constant) = operand.strip_prefix('$') {
        return parse_integer(constant)
            .map(Location::Constant)
            .ok_or_else(|| format!("`{constant}` is not an integer constant"));
    }
    if let Some(name) = operand.strip_prefix('%') {
        return register(name).map(Location::Register);
    }
    let (displacement_text, registers) = match operand.find('(') {
        Some(open) => {
            let inner = operand[open + 1..].strip_suffix(')').ok_or("a memory operand must end with `)`")?;
            (&operand[..open], Some(inner))
        }
        None => (operand, None),
    };
    let displacement = parse_displacement(displacement_text)?;
    let (base, index) = match registers {
        None => (None, None),
        Some(inner) => parse_memory_registers(inner)?,
    };
    Ok(Location::Memory { displacement, base, index })
}

fn register(name: &str) -> Result<Register, String> {
    Register::named(name).ok_or_else(|| format!("`%{name}` is not a general-purpose register"))
}

/// `%base`, `%base,%index`, `%base,%index,scale`, `,%index,scale`.
/// A memory operand's base register and (index register, scale).
type MemoryRegisters = (Option<Register>, Option<(Register, u8)>);

fn parse_memory_registers(inner: &str) -> Result<MemoryRegisters, String> {
    let parts: Vec<&str> = inner.split(',').map(str::trim).collect();
    if parts.len() > 3 {
        return Err("a memory operand has at most base, index and scale".into());
    }
    let base = match parts[0] {
        "" => None,
        text => Some(register(text.strip_prefix('%').ok_or("expected `%` before the base register")?)?),
    };
    let index = match parts.get(1) {
        None | Some(&"") => None,
        Some(text) => {
            let index = register(text.strip_prefix('%').ok_or("expected `%` before the index register")?)?;
            let scale = match parts.get(2).copied().unwrap_or("1") {
                "1" => 1,
                "2" => 2,
                "4" => 4,
                "8" => 8,
                other => return Err(format!("scale `{other}` is not 1, 2, 4 or 8")),
            };
            Some((index, scale))
        }
    };
    if base.is_none() && index.is_none() && parts.len() > 1 {
        return Err("a memory operand needs a base or an index register".into());
    }
    Ok((base, index))
}

/// `-12`, `0x10`, `counter`, `counter+8`, `counter-8`, or nothing (0).
fn parse_displacement(text: &str) -> Result<Displacement, String> {
    if text.is_empty() {
        return Ok(Displacement { symbol: None, offset: 0 });
    }
    if let Some(offset) = parse_integer(text) {
        return Ok(Displacement { symbol: None, offset });
    }
    // A symbol, maybe with an offset after its name (symbols do not start with a digit or sign).
    let split = text.char_indices().skip(1).find(|&(_, c)| c == '+' || c == '-').map(|(i, _)| i);
    let (symbol, offset) = match split {
        Some(i) => {
            let offset_text = text[i..].strip_prefix('+').unwrap_or(&text[i..]);
            let offset =
                parse_integer(offset_text).ok_or_else(|| format!("`{text}` is not a displacement"))?;
            (&text[..i], offset)
        }
        None => (text, 0),
    };
    let valid_symbol = symbol.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '.')
        && symbol.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '$'));
    if !valid_symbol {
        return Err(format!("`{text}` is not a displacement"));
    }
    Ok(Displacement { symbol: Some(symbol.to_owned()), offset })
}

/// A decimal or 0x-hexadecimal integer with an optional sign; values up to u64::MAX wrap into i64.
fn parse_integer(text: &str) -> Option<i64> {
    let (negative, magnitude) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let value = match magnitude.strip_prefix("0x").or_else(|| magnitude.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok()?,
        None if magnitude.starts_with(|c: char| c.is_ascii_digit()) => magnitude.parse().ok()?,
        None => return None,
    };
    Some(if negative { (value as i64).wrapping_neg() } else { value as i64 })
}

/// Where the probe site is, for arguments that name a symbol.
pub struct SiteContext<'a> {
    /// The site's link-time address (after the .stapsdt.base adjustment).
    pub address: u64,
    /// The link-time address of a symbol of the object.
    pub symbol_address: &'a dyn Fn(&str) -> Option<u64>,
}

impl ArgSpec {
    /// The spec in the form the BPF handler evaluates.
    pub fn to_bpf(&self, site: &SiteContext<'_>) -> Result<UsdtArg, ArgError> {
        let fail = |reason: String| ArgError { spec: self.text.clone(), reason };
        let mut arg = UsdtArg { size: self.size, signed: u8::from(self.signed), ..UsdtArg::default() };
        match &self.location {
            Location::Constant(value) => {
                arg.location = usdt_location::CONSTANT;
                arg.value = *value;
            }
            Location::Register(register) => {
                arg.location = usdt_location::REGISTER;
                arg.register_offset = register.offset;
                arg.register_shift = register.shift;
            }
            Location::Memory { displacement, base, index } => {
                arg.location = usdt_location::MEMORY;
                arg.value = displacement.offset;
                let mut base = *base;
                if let Some(symbol) = &displacement.symbol {
                    let address = (site.symbol_address)(symbol)
                        .ok_or_else(|| fail(format!("symbol `{symbol}` is not in the object")))?;
                    match base {
                        // The object may be loaded anywhere: the symbol's run-time address is the
                        // site's run-time address (the saved %rip at the probe) plus their link-time
                        // distance.
                        None => {
                            base = Register::named("rip");
                            arg.value = arg.value.wrapping_add(address.wrapping_sub(site.address) as i64);
                        }
                        Some(register) if register.is_instruction_pointer() => {
                            arg.value = arg.value.wrapping_add(address.wrapping_sub(site.address) as i64);
                        }
                        // `table(,%rax,8)` only occurs in position-dependent code: absolute.
                        Some(_) => arg.value = arg.value.wrapping_add(address as i64),
                    }
                }
                if let Some(base) = base {
                    arg.has_base = 1;
                    arg.register_offset = base.offset;
                }
                if let Some((index, scale)) = index {
                    arg.index_offset = index.offset;
                    arg.scale = *scale;
                }
            }
        }
        Ok(arg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(name: &str) -> Register {
        Register::named(name).unwrap()
    }

    #[test]
    fn registers_of_every_width() {
        for (name, full, shift) in [
            ("rax", "rax", 0),
            ("eax", "rax", 0),
            ("ax", "rax", 0),
            ("al", "rax", 0),
            ("ah", "rax", 8),
            ("dil", "rdi", 0),
            ("r8", "r8", 0),
            ("r8d", "r8", 0),
            ("r8w", "r8", 0),
            ("r8b", "r8", 0),
            ("r15d", "r15", 0),
            ("rbp", "rbp", 0),
            ("rsp", "rsp", 0),
        ] {
            let register = reg(name);
            assert_eq!((register.name, register.shift), (full, shift), "{name}");
        }
        assert_eq!(reg("rdi").offset, 112);
        assert_eq!(reg("r15").offset, 0);
        assert_eq!(reg("rip").offset, 128);
        for bad in ["r16", "r8q", "xmm0", "", "r", "r8dd", "eflags"] {
            assert!(Register::named(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn the_forms_gcc_and_clang_emit() {
        let spec = parse("-4@%eax").unwrap();
        assert_eq!((spec.size, spec.signed, spec.location), (4, true, Location::Register(reg("eax"))));
        let spec = parse("8@%rdi").unwrap();
        assert_eq!((spec.size, spec.signed, spec.location), (8, false, Location::Register(reg("rdi"))));
        assert_eq!(parse("8@$5").unwrap().location, Location::Constant(5));
        assert_eq!(parse("-4@$-1").unwrap().location, Location::Constant(-1));
        assert_eq!(parse("8@$0x10").unwrap().location, Location::Constant(16));
        assert_eq!(
            parse("-4@-12(%rbp)").unwrap().location,
            Location::Memory {
                displacement: Displacement { symbol: None, offset: -12 },
                base: Some(reg("rbp")),
                index: None
            }
        );
        assert_eq!(
            parse("8@16(%rax,%rbx,8)").unwrap().location,
            Location::Memory {
                displacement: Displacement { symbol: None, offset: 16 },
                base: Some(reg("rax")),
                index: Some((reg("rbx"), 8))
            }
        );
        assert_eq!(
            parse("8@(,%rbx,4)").unwrap().location,
            Location::Memory {
                displacement: Displacement { symbol: None, offset: 0 },
                base: None,
                index: Some((reg("rbx"), 4))
            }
        );
        assert_eq!(
            parse("-4@counter+4(%rip)").unwrap().location,
            Location::Memory {
                displacement: Displacement { symbol: Some("counter".into()), offset: 4 },
                base: Some(reg("rip")),
                index: None
            }
        );
        let all = parse_all("8@%rdi -8@%rsi 4@$3").unwrap();
        assert_eq!(all.len(), 3);
        assert!(parse_all("").unwrap().is_empty());
    }

    #[test]
    fn bad_specs_say_why() {
        for (bad, why) in [
            ("3@%eax", "1, 2, 4 or 8"),
            ("8@%xmm0", "general-purpose"),
            ("8f@%xmm0", "floating-point"),
            ("-8f@%xmm0", "floating-point"),
            ("8@$abc", "integer constant"),
            ("8@16(%rax", "end with `)`"),
            ("8@(%rax,%rbx,3)", "scale"),
            ("@%rax", "SIZE@OPERAND"),
            ("8@", "SIZE@OPERAND"),
            ("8@1+(%rax)", "displacement"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.to_string().contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn symbols_become_relative_to_the_site() {
        let symbol_address = |name: &str| (name == "counter").then_some(0x4010);
        let site = SiteContext { address: 0x1130, symbol_address: &symbol_address };
        let arg = parse("-4@counter+4(%rip)").unwrap().to_bpf(&site).unwrap();
        assert_eq!(arg.location, usdt_location::MEMORY);
        assert_eq!(arg.has_base, 1);
        assert_eq!(arg.register_offset, 128);
        assert_eq!(arg.value, 0x4010 + 4 - 0x1130);
        assert_eq!((arg.size, arg.signed), (4, 1));
        assert!(parse("8@missing(%rip)").unwrap().to_bpf(&site).is_err());
        let arg = parse("8@16(%rax,%rbx,8)").unwrap().to_bpf(&site).unwrap();
        assert_eq!((arg.value, arg.register_offset, arg.index_offset, arg.scale), (16, 80, 40, 8));
        let arg = parse("1@%ah").unwrap().to_bpf(&site).unwrap();
        assert_eq!((arg.register_shift, arg.size), (8, 1));
    }

    fn arm64(spec: &str) -> Location {
        parse_in(spec, Dialect::Aarch64).unwrap_or_else(|err| panic!("{err}")).location
    }

    /// Offsets in arm64's user_pt_regs (arch/arm64/include/uapi/asm/ptrace.h): regs[n] at 8n, sp
    /// at 248; specs as gcc writes them for aarch64.
    #[test]
    fn arm64_specs_read_user_pt_regs() {
        let (x0, x19, sp) = (
            super::super::arm64_args::register("x0"),
            super::super::arm64_args::register("x19"),
            super::super::arm64_args::register("sp"),
        );
        assert_eq!(arm64("8@x0"), Location::Register(x0.unwrap()));
        assert_eq!(arm64("-4@w0"), Location::Register(x0.unwrap()));
        assert_eq!(x19.unwrap().offset, 152);
        assert_eq!(sp.unwrap().offset, 248);
        let Location::Memory { displacement, base, index: None } = arm64("-4@[sp, 12]") else {
            panic!("not memory")
        };
        assert_eq!((displacement.offset, base.map(|b| b.offset)), (12, Some(248)));
        let Location::Memory { displacement, base, .. } = arm64("8@[x1, -8]") else { panic!("not memory") };
        assert_eq!((displacement.offset, base.map(|b| b.offset)), (-8, Some(8)));
        let Location::Memory { displacement, .. } = arm64("4@[x2]") else { panic!("not memory") };
        assert_eq!(displacement.offset, 0);
        assert_eq!(arm64("4@5"), Location::Constant(5));
        assert_eq!(arm64("-8@-3"), Location::Constant(-3));
    }

    #[test]
    fn what_is_not_arm64_is_refused() {
        for spec in ["8@%rdi", "8@x31", "8@[x1, -8", "8@[q1]", "4@$5", "8@-12(%rbp)"] {
            assert!(parse_in(spec, Dialect::Aarch64).is_err(), "{spec}");
        }
    }
}
