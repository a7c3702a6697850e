//! Canonical JSON, after RFC 8785: object members sorted by key, array order
//! kept, numbers in one form, no insignificant whitespace.
//!
//! Nesting depth is bounded by `serde_json`'s parser (128 levels), so the
//! recursion here cannot overflow the stack on a hostile body.
//!
//! Differences from RFC 8785, both harmless for hashing: members are sorted
//! by UTF-8 bytes rather than UTF-16 code units, and a number is its exact
//! decimal value, not the f64 nearest it (see [`number`]): `1`, `1.0` and
//! `1e0` are one number, and so are `1e16` and `10000000000000000`, but
//! two numbers of different values never are, however many digits they
//! have. (RFC 8785 reads numbers as I-JSON's doubles, so that
//! `100000000000000000001` and `100000000000000000002` would be one: two
//! events whose key is derived from such an identifier would share a
//! record, and the second be answered with the first's answer.)

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

/// A JSON value as canonicalization reads it: a number is kept as its
/// canonical text, which is its exact value (see [`number`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Number(Box<str>),
    String(String),
    Array(Vec<Json>),
    /// Sorted by key, as UTF-8 bytes.
    Object(BTreeMap<String, Json>),
}

impl Json {
    /// What a JSON pointer (RFC 6901) names, as `serde_json::Value::pointer`
    /// finds it.
    pub fn pointer(&self, pointer: &str) -> Option<&Json> {
        if pointer.is_empty() {
            return Some(self);
        }
        let tokens = pointer.strip_prefix('/')?.split('/');
        tokens.map(unescape).try_fold(self, |target, token| match target {
            Json::Object(members) => members.get(&token),
            Json::Array(items) => index(&token).and_then(|i| items.get(i)),
            _ => None,
        })
    }

    fn pointer_mut(&mut self, pointer: &str) -> Option<&mut Json> {
        if pointer.is_empty() {
            return Some(self);
        }
        let tokens = pointer.strip_prefix('/')?.split('/');
        tokens.map(unescape).try_fold(self, |target, token| match target {
            Json::Object(members) => members.get_mut(&token),
            Json::Array(items) => index(&token).and_then(|i| items.get_mut(i)),
            _ => None,
        })
    }
}

/// A pointer's token as the name it stands for (RFC 6901 §4).
fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

/// An array index as a pointer writes one: digits, no sign, no leading zero.
fn index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// A JSON text as a value; `None` when it is not JSON (to `serde_json`,
/// which refuses a number past an f64's range, `1e400`), when an object in
/// it names a member twice, or when a number's exponent is past what 64
/// bits hold. RFC 8785 canonicalizes I-JSON (RFC 7493), which has no such
/// objects: which of the two a backend reads is its own choice, and
/// `serde_json` keeps the last, so `{"amount":1,"amount":100}` would
/// fingerprint (or derive a key) as `{"amount":100}` whatever the backend
/// made of it. Such a body counts as not JSON: its raw bytes are
/// fingerprinted.
pub fn parse(bytes: &[u8]) -> Option<Json> {
    let numbers = Numbers {
        text: bytes,
        at: Cell::new(0),
    };
    let mut parser = serde_json::Deserializer::from_slice(bytes);
    let value = Strict(&numbers).deserialize(&mut parser).ok()?;
    parser.end().ok()?;
    Some(value)
}

/// The number tokens of a JSON text, handed out in the order they come:
/// `serde_json` reads a text from its start to its end and hands each
/// number to the visitor as it reads it, but as an `i64`, `u64` or the f64
/// nearest it, where the canonical form needs its digits.
struct Numbers<'t> {
    text: &'t [u8],
    /// Where the next one is looked for: after the last one handed out,
    /// so outside any string.
    at: Cell<usize>,
}

impl<'t> Numbers<'t> {
    fn next(&self) -> Option<&'t [u8]> {
        let text = self.text;
        let mut i = self.at.get();
        while let Some(&byte) = text.get(i) {
            match byte {
                b'"' => {
                    i += 1;
                    while let Some(&byte) = text.get(i)
                        && byte != b'"'
                    {
                        i += if byte == b'\\' { 2 } else { 1 };
                    }
                    i += 1;
                }
                b'-' | b'0'..=b'9' => {
                    let start = i;
                    while text
                        .get(i)
                        .is_some_and(|b| matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                    {
                        i += 1;
                    }
                    self.at.set(i);
                    return Some(&text[start..i]);
                }
                _ => i += 1,
            }
        }
        self.at.set(i);
        None
    }

    /// The next number's canonical form.
    fn canonical<E: serde::de::Error>(&self) -> Result<Json, E> {
        let token = self
            .next()
            .ok_or_else(|| E::custom("a number the text does not hold"))?;
        let text = number(token).ok_or_else(|| E::custom("a number's exponent is out of range"))?;
        Ok(Json::Number(text.into()))
    }
}

/// Reads a JSON value as `serde_json::Value` would, but for duplicate
/// members (refused) and numbers (their canonical text).
#[derive(Clone, Copy)]
struct Strict<'n, 't>(&'n Numbers<'t>);

impl<'de> DeserializeSeed<'de> for Strict<'_, '_> {
    type Value = Json;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict<'_, '_> {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
        Ok(Json::Bool(b))
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Json, E> {
        self.0.canonical()
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Json, E> {
        self.0.canonical()
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Json, E> {
        self.0.canonical()
    }

    fn visit_str<E>(self, s: &str) -> Result<Json, E> {
        Ok(Json::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Json, E> {
        Ok(Json::String(s))
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut members = BTreeMap::new();
        while let Some(name) = map.next_key::<String>()? {
            let value = map.next_value_seed(self)?;
            if members.insert(name, value).is_some() {
                return Err(A::Error::custom("an object names a member twice"));
            }
        }
        Ok(Json::Object(members))
    }
}

/// The canonical text of a number token (RFC 8259's grammar, which the
/// parser has checked): its exact value, written as an integer when it is
/// one from -2^63 up to (not including) 2^64, else as Rust writes an f64,
/// `d.ddde<x>` with no trailing zeros (`2.5e0`, `1e300`, `-1.7e-186`).
/// Two tokens have one text exactly when they have one value. A number
/// an f64 or a 64-bit integer holds exactly is written as earlier versions
/// wrote it (as the f64's shortest form, or the integer); one it does not
/// (an integer from 2^64, more than 15 significant digits, a float past
/// 2^53 an f64 rounds) was written as the f64 nearest it, which it shared
/// with other values. `None` when the exponent is past what 64 bits hold.
fn number(token: &[u8]) -> Option<String> {
    let (negative, unsigned) = match token.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, token),
    };
    let (mantissa, exponent) = match unsigned.iter().position(|b| matches!(b, b'e' | b'E')) {
        Some(at) => (&unsigned[..at], &unsigned[at + 1..]),
        None => (unsigned, &b"0"[..]),
    };
    let (whole, fraction) = match mantissa.iter().position(|&b| b == b'.') {
        Some(at) => (&mantissa[..at], &mantissa[at + 1..]),
        None => (mantissa, &[][..]),
    };
    let digits: Vec<u8> = whole.iter().chain(fraction).copied().collect();
    let Some(first) = digits.iter().position(|&d| d != b'0') else {
        return Some("0".to_owned());
    };
    // Read only now: zero is zero, whatever its exponent.
    let exponent: i64 = std::str::from_utf8(exponent).ok()?.parse().ok()?;
    let last = digits.iter().rposition(|&d| d != b'0').expect("a digit that is not 0");
    let significant = std::str::from_utf8(&digits[first..=last]).ok()?;
    // The value is `significant` times ten to the `scale`.
    let trailing_zeros = i64::try_from(digits.len() - 1 - last).ok()?;
    let scale = exponent
        .checked_sub(i64::try_from(fraction.len()).ok()?)?
        .checked_add(trailing_zeros)?;
    let sign = if negative { "-" } else { "" };
    if (0..=20).contains(&scale) && significant.len() as i64 + scale <= 20 {
        let integer = format!("{sign}{significant}{}", "0".repeat(scale as usize));
        let fits = if negative {
            integer.parse::<i64>().is_ok()
        } else {
            integer.parse::<u64>().is_ok()
        };
        if fits {
            return Some(integer);
        }
    }
    let power = scale.checked_add(significant.len() as i64 - 1)?;
    let (lead, rest) = significant.split_at(1);
    let point = if rest.is_empty() { "" } else { "." };
    Some(format!("{sign}{lead}{point}{rest}e{power}"))
}

/// Writes `value` canonically into `out`.
pub fn write(value: &Json, out: &mut Vec<u8>) {
    match value {
        Json::Null => out.extend_from_slice(b"null"),
        Json::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Json::Number(n) => out.extend_from_slice(n.as_bytes()),
        Json::String(s) => write_string(s, out),
        Json::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Json::Object(members) => {
            out.push(b'{');
            for (i, (k, v)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(k, out);
                out.push(b':');
                write(v, out);
            }
            out.push(b'}');
        }
    }
}

/// The canonical form of `value` as bytes.
pub fn to_vec(value: &Json) -> Vec<u8> {
    let mut out = Vec::new();
    write(value, &mut out);
    out
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    // serde_json escapes only what JSON requires, which is RFC 8785's rule.
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}

/// Orders `pointers` so that removing them one after another (with
/// [`remove_pointer`]) removes what each names in the document as it came:
/// in an array, later elements first, as removing one shifts those after
/// it; inside an element or member, before the element or member itself.
/// A pointer listed twice is kept once: removed twice, it would take the
/// element after the one it names too.
pub fn sort_for_removal(pointers: &mut Vec<String>) {
    fn tokens(pointer: &str) -> impl Iterator<Item = (Option<usize>, &str)> {
        pointer.split('/').skip(1).map(|token| (index(token), token))
    }
    // Indexes (as a pointer writes them: `01` is a member's name) in
    // their numeric order, then names; a total order.
    pointers.sort_by(|a, b| {
        let order = tokens(a)
            .zip(tokens(b))
            .map(|((i, x), (j, y))| match (i, j) {
                (Some(i), Some(j)) => i.cmp(&j),
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (None, None) => x.cmp(y),
            })
            .find(|o| o.is_ne())
            .unwrap_or_else(|| tokens(a).count().cmp(&tokens(b).count()));
        order.reverse()
    });
    pointers.dedup();
}

/// Removes the member or element a JSON pointer (RFC 6901) names, if any.
/// Several are removed in the order [`sort_for_removal`] gives them.
pub fn remove_pointer(value: &mut Json, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    match value.pointer_mut(parent) {
        Some(Json::Object(members)) => {
            members.remove(&unescape(last));
        }
        Some(Json::Array(items)) => {
            if let Some(i) = index(last)
                && i < items.len()
            {
                items.remove(i);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str) -> String {
        String::from_utf8(to_vec(&parse(text.as_bytes()).unwrap_or_else(|| panic!("{text}")))).unwrap()
    }

    #[test]
    fn parsing_is_serde_json_but_for_members_named_twice() {
        for text in [
            r#"{"b":1,"a":[3,2,{"d":null,"c":true}],"s":"\u00e9\n"}"#,
            "[1, 1.0, 1e300, -0.0, 18446744073709551615, -9223372036854775808]",
            "1e400",
            r#""text""#,
            "null",
            " {} ",
        ] {
            let ours = parse(text.as_bytes());
            let theirs = serde_json::from_str::<serde_json::Value>(text).ok();
            assert_eq!(ours.is_some(), theirs.is_some(), "{text}");
            assert!(ours.is_some() || text.contains("1e400"), "{text}");
        }
        for text in [
            r#"{"amount":1,"amount":100}"#,
            r#"{"a":{"x":1,"y":2,"x":1}}"#,
            r#"[{"id":1},{"id":2,"id":2}]"#,
            "{} x",
            "{",
        ] {
            assert_eq!(parse(text.as_bytes()), None, "{text}");
        }
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert_eq!(parse(deep.as_bytes()), None, "nesting stays bounded");
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert_eq!(
            canon(r#"{ "b": 1, "a": [3, 2, {"d":null,"c":true}] }"#),
            r#"{"a":[3,2,{"c":true,"d":null}],"b":1}"#
        );
    }

    #[test]
    fn numbers_have_one_form() {
        assert_eq!(canon("[1, 1.0, 1e0, -0.0, 2.5, 1e300]"), "[1,1,1,0,2.5e0,1e300]");
        // Past 2^53, an integral float and the integer literal of its
        // value are one number too, up to the integers' range.
        assert_eq!(
            canon("[1e16, 10000000000000000, -1e16, -10000000000000000, 1.8e19, 18000000000000000000]"),
            "[10000000000000000,10000000000000000,-10000000000000000,-10000000000000000,\
             18000000000000000000,18000000000000000000]"
        );
        assert_eq!(
            canon("[-9.223372036854775808e18, 1e20, 100000000000000000000]"),
            "[-9223372036854775808,1e20,1e20]"
        );
        // Read correctly rounded, whatever the spelling: serde_json's fast
        // reading, off by one unit in the last place for some long
        // mantissas, made these two numbers.
        assert_eq!(canon("-170567187269580742e-203"), canon("-1.705671872695807420e-186"));
        // Tokens inside strings are not numbers; every number is found.
        assert_eq!(
            canon(r#"{"s":"-1e5 \" 2","n":[-0,1E+2,3.50e-1],"t":"\\","m":7}"#),
            r#"{"m":7,"n":[0,100,3.5e-1],"s":"-1e5 \" 2","t":"\\"}"#
        );
    }

    /// Numbers of different values have different forms, however close
    /// they are: one f64 (or its rounding into an integer) held them both.
    #[test]
    fn numbers_of_different_values_differ() {
        for (one, other) in [
            ("-9223372036854775808", "-9223372036854775809"),
            ("100000000000000000001", "100000000000000000002"),
            ("18446744073709551616", "18446744073709552000"),
            ("1", "1.00000000000000000001"),
            ("1152921504606846976", "1152921504606847000.0"),
            ("9999999999999989760", "9.99999999999999e18"),
            ("0.1", "0.1000000000000000055511151231257827"),
            ("0", "1e-400"),
            ("1e-400", "1e-401"),
        ] {
            assert_ne!(canon(one), canon(other), "{one} and {other}");
        }
        assert_eq!(canon("[100000000000000000001]"), "[1.00000000000000000001e20]");
        assert_eq!(canon("-9223372036854775809"), "-9.223372036854775809e18");
        // An exponent past 64 bits is not read (the body's bytes are),
        // unless the number is zero.
        assert!(parse(b"1e99999999999999999999").is_none());
        assert_eq!(canon("[0e99999999999999999999, -0.0E-99999999999999999999]"), "[0,0]");
    }

    /// The form earlier versions gave a number, where it named that
    /// number's value exactly (an f64's shortest form, or an integer).
    fn earlier(token: &str) -> String {
        let n: serde_json::Number = serde_json::from_str(token).unwrap();
        if let Some(i) = n.as_i64() {
            return i.to_string();
        }
        if let Some(u) = n.as_u64() {
            return u.to_string();
        }
        let f = n.as_f64().unwrap();
        if f.fract() == 0.0 && (i64::MIN as f64..18_446_744_073_709_551_616.0).contains(&f) {
            return if f < 0.0 {
                (f as i64).to_string()
            } else {
                (f as u64).to_string()
            };
        }
        format!("{f:e}")
    }

    /// Every number whose earlier form was its exact value keeps that form:
    /// fingerprints and derived keys change only where two values shared
    /// one.
    #[test]
    fn numbers_keep_their_earlier_form_where_it_was_exact() {
        let mut next = crate::testing::numbers(0x2545_F491_4F6C_DD1D);
        let (mut kept, mut changed) = (0, 0);
        for _ in 0..20_000 {
            let digits: String = (0..1 + next(20)).map(|_| char::from(b'0' + next(10) as u8)).collect();
            let token = match next(3) {
                0 => digits,
                1 => format!("-{}.{}5", &digits[..1], &digits[1..]),
                _ => format!("{}e{}", digits, next(80) as i64 - 40),
            };
            let token = token.trim_start_matches('0');
            let token = if token.is_empty() || token.starts_with(['.', 'e']) {
                format!("0{token}")
            } else {
                token.to_owned()
            };
            let Some(ours) = number(token.as_bytes()) else { continue };
            let before = earlier(&token);
            if number(before.as_bytes()).as_deref() == Some(ours.as_str()) {
                assert_eq!(ours, before, "{token}");
                kept += 1;
            } else {
                changed += 1;
            }
        }
        assert!(kept > 10_000 && changed > 100, "{kept} kept, {changed} changed");
    }

    /// Writes random JSON values, each in one of its many spellings
    /// (whitespace, member order, escapes, number forms).
    struct Writer {
        numbers: Box<dyn FnMut(usize) -> usize>,
    }

    impl Writer {
        fn next(&mut self, below: u64) -> u64 {
            (self.numbers)(below as usize) as u64
        }

        fn space(&mut self, out: &mut String) {
            for _ in 0..self.next(3) {
                out.push([' ', '\n', '\t', '\r'][self.next(4) as usize]);
            }
        }

        /// A number given as digits and a power of ten, in one of its
        /// spellings.
        fn number(&mut self, digits: u64, exp: i32, negative: bool, out: &mut String) {
            let digits = digits.to_string();
            let sign = if negative { "-" } else { "" };
            // d.ddd x 10^(exp + len - 1), or ddd x 10^exp, or 0.ddd x ...
            let len = digits.len() as i32;
            match self.next(4) {
                0 => out.push_str(&format!("{sign}{digits}e{exp}")),
                1 => out.push_str(&format!("{sign}{}.{}0e{}", &digits[..1], &digits[1..], exp + len - 1)),
                2 => out.push_str(&format!("{sign}0.{digits}E{}", exp + len)),
                // An integer literal is exact (see the module's notes): only
                // where an f64 is too is it the same number as the others.
                _ if (0..6).contains(&exp) && (digits.parse::<u128>().unwrap() * 10u128.pow(exp as u32)) <= 1 << 53 => {
                    out.push_str(&format!("{sign}{digits}{}", "0".repeat(exp as usize)))
                }
                _ if exp < 0 && -exp < len => {
                    let point = (len + exp) as usize;
                    out.push_str(&format!("{sign}{}.{}", &digits[..point], &digits[point..]))
                }
                _ => out.push_str(&format!("{sign}{digits}e{exp:+}")),
            }
        }

        fn value(&mut self, depth: u32, spec: &mut Vec<u64>, replay: &mut std::slice::Iter<'_, u64>, out: &mut String) {
            // The value's shape comes from `replay` when there is one, so a
            // second writing of it is the same value in other forms.
            let mut shape = |w: &mut Writer, below: u64| match replay.next() {
                Some(&v) => v,
                None => {
                    let v = w.next(below);
                    spec.push(v);
                    v
                }
            };
            self.space(out);
            let kind = shape(self, if depth > 3 { 4 } else { 6 });
            match kind {
                0 => out.push_str(["null", "true", "false"][shape(self, 3) as usize]),
                1 => {
                    let (digits, exp) = (shape(self, 10_000_000_000_000_000_000), shape(self, 580) as i32 - 300);
                    let negative = shape(self, 2) == 0;
                    self.number(digits, exp, negative, out);
                }
                2 => {
                    let small = shape(self, 100_000);
                    out.push_str(&format!("{small}"));
                }
                3 => {
                    out.push('"');
                    for _ in 0..shape(self, 6) {
                        let c = ['a', 'Z', ' ', '/', '\\', '"', '\u{e9}'][shape(self, 7) as usize];
                        match (c, self.next(2)) {
                            ('\\', _) => out.push_str("\\\\"),
                            ('"', _) => out.push_str("\\\""),
                            (c, 0) => out.push_str(&format!("\\u{:04x}", c as u32)),
                            (c, _) => out.push(c),
                        }
                    }
                    out.push('"');
                }
                4 => {
                    out.push('[');
                    let n = shape(self, 4);
                    for i in 0..n {
                        if i > 0 {
                            out.push(',');
                        }
                        self.value(depth + 1, spec, replay, out);
                    }
                    self.space(out);
                    out.push(']');
                }
                _ => {
                    // Members in a random order each writing.
                    let n = shape(self, 4);
                    let mut order: Vec<u64> = (0..n).collect();
                    for i in (1..order.len()).rev() {
                        order.swap(i, self.next(i as u64 + 1) as usize);
                    }
                    let mut members = vec![String::new(); n as usize];
                    for member in members.iter_mut() {
                        self.value(depth + 1, spec, replay, member);
                    }
                    out.push('{');
                    for (i, &at) in order.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        self.space(out);
                        out.push_str(&format!("\"k{at}\":"));
                        out.push_str(&members[at as usize]);
                    }
                    self.space(out);
                    out.push('}');
                }
            }
            self.space(out);
        }
    }

    /// Random documents, each written twice with other whitespace, member
    /// order, escapes and spellings of its numbers: one canonical text,
    /// which parses back to itself.
    #[test]
    fn one_value_in_any_spelling_has_one_canonical_form() {
        let mut writer = Writer {
            numbers: Box::new(crate::testing::numbers(0x9E37_79B9_7F4A_7C15)),
        };
        for _ in 0..3000 {
            let (mut spec, mut first) = (Vec::new(), String::new());
            writer.value(0, &mut spec, &mut [].iter(), &mut first);
            let mut second = String::new();
            writer.value(0, &mut Vec::new(), &mut spec.iter(), &mut second);
            let one = to_vec(&parse(first.as_bytes()).unwrap_or_else(|| panic!("{first}")));
            let two = to_vec(&parse(second.as_bytes()).unwrap_or_else(|| panic!("{second}")));
            assert_eq!(
                String::from_utf8_lossy(&one),
                String::from_utf8_lossy(&two),
                "{first} and {second}"
            );
            assert_eq!(to_vec(&parse(&one).unwrap()), one, "{first}");
        }
    }

    #[test]
    fn strings_escape_minimally() {
        assert_eq!(canon(r#""a\u0041\n\u00e9""#), "\"aA\\né\"");
    }

    #[test]
    fn pointers_remove_members_and_elements() {
        let mut v = parse(br#"{"a":{"t":1,"k":2},"l":[1,2,3],"x/y":0}"#).unwrap();
        remove_pointer(&mut v, "/a/t");
        remove_pointer(&mut v, "/l/1");
        remove_pointer(&mut v, "/x~1y");
        remove_pointer(&mut v, "/missing/deep");
        assert_eq!(String::from_utf8(to_vec(&v)).unwrap(), r#"{"a":{"k":2},"l":[1,3]}"#);
    }

    #[test]
    fn pointers_into_one_array_remove_what_they_name_in_the_original() {
        let mut pointers: Vec<String> = ["/items/0", "/items/1/id", "/items/1", "/items/10", "/items/2/id", "/n"]
            .map(String::from)
            .to_vec();
        sort_for_removal(&mut pointers);
        assert_eq!(
            pointers,
            ["/n", "/items/10", "/items/2/id", "/items/1/id", "/items/1", "/items/0"]
        );
        let mut v = parse(br#"{"items":["p","q",{"id":7,"k":1},"r"],"n":1}"#).unwrap();
        let mut pointers = ["/items/0", "/items/1", "/items/2/id", "/items/1"]
            .map(String::from)
            .to_vec();
        sort_for_removal(&mut pointers);
        for pointer in &pointers {
            remove_pointer(&mut v, pointer);
        }
        // p and q went, and the id of the third: not r.
        assert_eq!(
            String::from_utf8(to_vec(&v)).unwrap(),
            r#"{"items":[{"k":1},"r"],"n":1}"#
        );
    }

    /// An index is written as RFC 6901 writes one: `01` and `+1` name no
    /// element (as for a derived key's pointer), and a member named `01`.
    #[test]
    fn pointers_name_elements_only_by_plain_indexes() {
        let mut pointers: Vec<String> = ["/l/01", "/l/+0", "/l/1", "/o/01", "/l/10", "/l/9", "/l/a"]
            .map(String::from)
            .to_vec();
        sort_for_removal(&mut pointers);
        assert_eq!(pointers, ["/o/01", "/l/a", "/l/01", "/l/+0", "/l/10", "/l/9", "/l/1"]);
        let mut v = parse(br#"{"l":[0,1,2],"o":{"01":1,"1":2}}"#).unwrap();
        for pointer in ["/l/01", "/l/+0", "/o/01"] {
            remove_pointer(&mut v, pointer);
            assert_eq!(v.pointer(pointer), None);
        }
        assert_eq!(String::from_utf8(to_vec(&v)).unwrap(), r#"{"l":[0,1,2],"o":{"1":2}}"#);
    }

    #[test]
    fn deep_nesting_is_refused_by_the_parser_not_the_stack() {
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(parse(deep.as_bytes()).is_none());
    }
}
