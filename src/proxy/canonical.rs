//! Canonical JSON, after RFC 8785: object members sorted by key, array order
//! kept, numbers in one form, no insignificant whitespace.
//!
//! Nesting depth is bounded by `serde_json`'s parser (128 levels), so the
//! recursion here cannot overflow the stack on a hostile body.
//!
//! Differences from RFC 8785, both harmless for hashing: members are sorted
//! by UTF-8 bytes rather than UTF-16 code units, and numbers are written by
//! Rust's shortest round-trip formatting (integral values from -2^63 up to
//! 2^64 as integers, so `1`, `1.0` and `1e0` are one number, and so are
//! `1e16` and `10000000000000000`; an integer literal stays exact, so
//! one past 2^53 that an f64 cannot hold is not the float it rounds to).
//! Numbers are read correctly rounded (serde_json's `float_roundtrip`), so
//! every spelling of one decimal value is one f64.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// A JSON text as a value; `None` when it is not JSON, or when an object in
/// it names a member twice. RFC 8785 canonicalizes I-JSON (RFC 7493), which
/// has no such objects: which of the two a backend reads is its own
/// choice, and `serde_json` keeps the last, so `{"amount":1,"amount":100}`
/// would fingerprint (or derive a key) as `{"amount":100}` whatever the
/// backend made of it. Such a body counts as not JSON: its raw bytes are
/// fingerprinted.
pub fn parse(bytes: &[u8]) -> Option<Value> {
    let mut parser = serde_json::Deserializer::from_slice(bytes);
    let value = Strict.deserialize(&mut parser).ok()?;
    parser.end().ok()?;
    Some(value)
}

/// `serde_json::Value`'s own deserialization, but for duplicate members.
struct Strict;

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(Strict)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(n).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Strict)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            let value = map.next_value_seed(Strict)?;
            if members.insert(name, value).is_some() {
                return Err(A::Error::custom("an object names a member twice"));
            }
        }
        Ok(Value::Object(members))
    }
}

/// Writes `value` canonically into `out`.
pub fn write(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            // serde_json's default map is a BTreeMap: already sorted.
            out.push(b'{');
            for (i, (k, v)) in map.iter().enumerate() {
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
pub fn to_vec(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write(value, &mut out);
    out
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    // serde_json escapes only what JSON requires, which is RFC 8785's rule.
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}

fn write_number(n: &serde_json::Number, out: &mut Vec<u8>) {
    if let Some(i) = n.as_i64() {
        out.extend_from_slice(i.to_string().as_bytes());
    } else if let Some(u) = n.as_u64() {
        out.extend_from_slice(u.to_string().as_bytes());
    } else if let Some(f) = n.as_f64() {
        // An integral value within the integers' range is written as the
        // integer it is, whichever form it came in: `1e16` is
        // `10000000000000000`, as that literal is. (Both bounds are powers
        // of two, exact in an f64, and so is every value between them
        // that has no fraction: the casts are exact.)
        const LOW: f64 = i64::MIN as f64;
        const HIGH: f64 = 18_446_744_073_709_551_616.0; // 2^64
        if f.fract() == 0.0 && (LOW..HIGH).contains(&f) {
            let integer = if f < 0.0 {
                (f as i64).to_string()
            } else {
                (f as u64).to_string()
            };
            out.extend_from_slice(integer.as_bytes());
        } else {
            out.extend_from_slice(format!("{f:e}").as_bytes());
        }
    }
}

/// Orders `pointers` so that removing them one after another (with
/// [`remove_pointer`]) removes what each names in the document as it came:
/// in an array, later elements first, as removing one shifts those after
/// it; inside an element or member, before the element or member itself.
pub fn sort_for_removal(pointers: &mut [String]) {
    fn tokens(pointer: &str) -> impl Iterator<Item = &str> {
        pointer.split('/').skip(1)
    }
    pointers.sort_by(|a, b| {
        let order = tokens(a)
            .zip(tokens(b))
            .map(|(x, y)| match (x.parse::<usize>(), y.parse::<usize>()) {
                (Ok(x), Ok(y)) => x.cmp(&y),
                _ => x.cmp(y),
            })
            .find(|o| o.is_ne())
            .unwrap_or_else(|| tokens(a).count().cmp(&tokens(b).count()));
        order.reverse()
    });
}

/// Removes the member or element a JSON pointer (RFC 6901) names, if any.
/// Several are removed in the order [`sort_for_removal`] gives them.
pub fn remove_pointer(value: &mut Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let last = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(Value::Object(map)) => {
            map.remove(&last);
        }
        Some(Value::Array(items)) => {
            if let Ok(i) = last.parse::<usize>()
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
        String::from_utf8(to_vec(&serde_json::from_str(text).unwrap())).unwrap()
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
            let theirs = serde_json::from_str::<Value>(text).ok();
            assert_eq!(ours, theirs, "{text}");
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
        let mut v: Value = serde_json::from_str(r#"{"a":{"t":1,"k":2},"l":[1,2,3],"x/y":0}"#).unwrap();
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
        let mut v: Value = serde_json::from_str(r#"{"items":["p","q",{"id":7,"k":1},"r"],"n":1}"#).unwrap();
        let mut pointers = ["/items/0", "/items/1", "/items/2/id"].map(String::from).to_vec();
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

    #[test]
    fn deep_nesting_is_refused_by_the_parser_not_the_stack() {
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(serde_json::from_str::<Value>(&deep).is_err());
    }
}
