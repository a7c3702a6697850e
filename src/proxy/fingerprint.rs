//! Step 3: the request fingerprint, SHA-256 over the method, path, query,
//! the route's host when it names one, the configured headers (each one's
//! lines as one value, joined by ",") and the body as configured.

use std::borrow::Cow;
use std::fmt::Write as _;

use bytes::Bytes;
use http::request::Parts;
use sha2::{Digest, Sha256};

use super::canonical::{self, Json};
use crate::config::{BodyMode, FingerprintPolicy};
use crate::store::Fingerprint;

/// `text` (a path or a query) with its percent-escapes in RFC 3986's
/// normal form (§6.2.2): an unreserved character's escape decoded (`%7E`
/// is `~`, `%41` is `A`), any other escape's hex digits in capitals
/// (`%c3%a9` is `%C3%A9`), and a byte no URI may hold as it is escaped
/// (raw UTF-8, a space, `"`, `<`, `>`, `\`, `^`, `` ` ``, `{`, `|`, `}`, a
/// control: parsers let them through; in a path `[` and `]` too, which
/// only a host may hold), so `/cafés` is `/caf%C3%A9s`, as routing and
/// `key.derive` read it; `not_as_is` says which bytes those are. A backend
/// that decodes them reads the same bytes either way, so a retry whose
/// client escapes otherwise is the same request, not a 422. Nothing else
/// changes: a reserved character and its escape (`/` and `%2F`, `+` and
/// `%2B`) may mean different things to a backend, and stay apart. A `%`
/// that starts no escape is `%25`, as a lenient decoder reads it.
/// Borrowed, with no work beyond one scan, when there is nothing to
/// change.
fn normal_escapes<'a>(text: &'a str, not_as_is: &[bool; 256]) -> Cow<'a, str> {
    let bytes = text.as_bytes();
    // The byte `bytes[at..]` escapes, if it opens with an escape.
    let escape = |at: usize| -> Option<u8> {
        let digit = |i: usize| (*bytes.get(i)? as char).to_digit(16);
        (bytes[at] == b'%').then_some(())?;
        Some((digit(at + 1)? * 16 + digit(at + 2)?) as u8)
    };
    let unreserved = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~');
    let normal = |at: usize, escaped: u8| {
        !unreserved(escaped) && !bytes[at + 1].is_ascii_lowercase() && !bytes[at + 2].is_ascii_lowercase()
    };
    // A `%` that starts no escape is written `%25`, as a lenient decoder
    // reads it: left bare, a hex digit decoded after it (`%%32%35`) would
    // make an escape the request never held (`%25`).
    let changes = |at: usize| {
        not_as_is[usize::from(bytes[at])] || bytes[at] == b'%' && escape(at).is_none_or(|escaped| !normal(at, escaped))
    };
    let Some(first) = (0..bytes.len()).find(|&at| changes(at)) else {
        return Cow::Borrowed(text);
    };
    let mut out = String::with_capacity(text.len() + 8);
    out.push_str(&text[..first]);
    let mut at = first;
    while at < bytes.len() {
        match escape(at) {
            Some(escaped) if unreserved(escaped) => out.push(char::from(escaped)),
            Some(escaped) => {
                let _ = write!(out, "%{escaped:02X}");
            }
            None if bytes[at] == b'%' => {
                out.push_str("%25");
                at += 1;
                continue;
            }
            None if not_as_is[usize::from(bytes[at])] => {
                let _ = write!(out, "%{:02X}", bytes[at]);
                at += 1;
                continue;
            }
            None => {
                // Escapes and bytes escaped are ASCII or whole characters'
                // bytes: `at` is on a character's boundary.
                let c = text[at..].chars().next().expect("a character");
                out.push(c);
                at += c.len_utf8();
                continue;
            }
        }
        at += 3;
    }
    Cow::Owned(out)
}

/// The bytes no URI holds as they are (RFC 3986 §2: neither unreserved,
/// reserved, nor `%`): every byte from 0x80 up, the controls, and space,
/// `"`, `<`, `>`, `\`, `^`, `` ` ``, `{`, `|`, `}`: a query's.
const NOT_AS_IS: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = b >= 0x80
            || b < 0x20
            || b == 0x7f
            || matches!(
                b as u8,
                b' ' | b'"' | b'<' | b'>' | b'\\' | b'^' | b'`' | b'{' | b'|' | b'}'
            );
        b += 1;
    }
    table
};

/// [`NOT_AS_IS`], and `[` and `]`, which only a URI's host holds: the
/// bytes routing escapes in a path (see [`crate::config::decode_unreserved`]).
const NOT_AS_IS_IN_PATH: [bool; 256] = {
    let mut table = NOT_AS_IS;
    table[b'[' as usize] = true;
    table[b']' as usize] = true;
    table
};

fn field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

/// Fingerprints a buffered request. `json` is the body already parsed, when
/// it is JSON; a body that is not JSON is fingerprinted by its raw bytes.
///
/// `host` is the matched route's own `host`, if it has one: records are kept
/// across routes, so without it the same key and body sent to two routes
/// told apart only by host (two backends) would replay the first one's
/// answer to the second. A route without `host` leaves it out, so every name
/// a client reaches it by shares one record, and its fingerprints are those
/// of earlier versions.
pub fn fingerprint(
    policy: &FingerprintPolicy,
    host: Option<&str>,
    parts: &Parts,
    body: &Bytes,
    json: Option<&Json>,
) -> Fingerprint {
    let mut hasher = Sha256::new();
    hasher.update(b"idemgate-fingerprint-v1");
    field(&mut hasher, parts.method.as_str().as_bytes());
    field(
        &mut hasher,
        normal_escapes(parts.uri.path(), &NOT_AS_IS_IN_PATH).as_bytes(),
    );
    field(
        &mut hasher,
        normal_escapes(parts.uri.query().unwrap_or(""), &NOT_AS_IS).as_bytes(),
    );
    if let Some(host) = host {
        // Tagged apart from a header name, whose field is length-first, and
        // from the body's `none`, `json` or `raw`.
        hasher.update(b"\xfehost");
        field(&mut hasher, host.as_bytes());
    }
    for name in &policy.headers {
        field(&mut hasher, name.as_str().as_bytes());
        let lines = parts.headers.get_all(name).iter();
        super::key::hash_lines(
            &mut hasher,
            &[],
            lines.map(|value| super::key::identity(name, value.as_bytes())),
        );
        hasher.update([0xff]);
    }
    match (policy.body, json) {
        (BodyMode::None, _) => hasher.update(b"none"),
        (BodyMode::Json, Some(json)) => {
            hasher.update(b"json");
            if policy.ignore.is_empty() {
                field(&mut hasher, &canonical::to_vec(json));
            } else {
                let mut json = json.clone();
                for pointer in &policy.ignore {
                    canonical::remove_pointer(&mut json, pointer);
                }
                field(&mut hasher, &canonical::to_vec(&json));
            }
        }
        (BodyMode::Raw | BodyMode::Json, _) => {
            hasher.update(b"raw");
            field(&mut hasher, body);
        }
    }
    Fingerprint(hasher.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(fingerprint: Fingerprint) -> String {
        fingerprint.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Fingerprints are stored: one computed differently after an upgrade
    /// turns every retry of a stored request into a 422. These are the
    /// values every version so far gives (a route without `host`), and the
    /// host route's own.
    #[test]
    fn fingerprints_are_those_stored_by_earlier_versions() {
        let policy = FingerprintPolicy {
            headers: vec![http::header::CONTENT_TYPE],
            body: BodyMode::Raw,
            ignore: Vec::new(),
        };
        let (parts, ()) = http::Request::post("/v1/orders?ref=7")
            .header("content-type", "application/json")
            .body(())
            .unwrap()
            .into_parts();
        let body = Bytes::from_static(br#"{"sku":1}"#);
        // Also worked out by hand from the format above (Python's hashlib).
        assert_eq!(
            hex(fingerprint(&policy, None, &parts, &body, None)),
            "a48f94c73022d4340f86b12f1b3df106a2965b4cc87a0e5b87484ac209ed0915"
        );
        assert_eq!(
            hex(fingerprint(&policy, Some("api.example.com"), &parts, &body, None)),
            "9bbdd24a399788785da885bd44eadd45bfc09d6360d37294c52f310a460978ca"
        );
    }

    /// Escapes a backend decodes alike fingerprint alike: in either case
    /// of hex, and an unreserved character escaped or not, and a `%` that
    /// starts no escape as `%25`. A reserved character and its escape stay
    /// apart, and a bare `%` and the hex digits decoded after it make no
    /// escape.
    #[test]
    fn escapes_that_decode_alike_fingerprint_alike() {
        let policy = FingerprintPolicy {
            headers: Vec::new(),
            body: BodyMode::None,
            ignore: Vec::new(),
        };
        let print = |target: &str| {
            let (parts, ()) = http::Request::post(target).body(()).unwrap().into_parts();
            fingerprint(&policy, None, &parts, &Bytes::new(), None)
        };
        for (a, b) in [
            ("/v1/orders?ref=a%c3%a9", "/v1/orders?ref=a%C3%A9"),
            ("/v1/%6Frders?ref=%7E%41", "/v1/orders?ref=~A"),
            ("/v1/a%2fb?x=%2b", "/v1/a%2Fb?x=%2B"),
            ("/v1/orders?ref=100%", "/v1/orders?ref=100%25"),
            ("/v1/orders?ref=%zz", "/v1/orders?ref=%25zz"),
        ] {
            assert_eq!(print(a), print(b), "{a} {b}");
        }
        for (a, b) in [
            ("/v1/a%2Fb", "/v1/a/b"),
            ("/v1/orders?x=%2B", "/v1/orders?x=+"),
            ("/v1/orders?x=%26", "/v1/orders?x=&"),
            ("/v1/orders?ref=%zz", "/v1/orders?ref=%ZZ"),
            // A bare `%`, then a hex digit decoded, is not an escape.
            ("/v1/orders?ref=%%32%35", "/v1/orders?ref=%25"),
            ("/v1/orders?ref=%%43%33", "/v1/orders?ref=%c3"),
            ("/v1/orders?ref=%C3%A9", "/v1/orders?ref=%C3%A8"),
        ] {
            assert_ne!(print(a), print(b), "{a} {b}");
        }
        assert_eq!(normal_escapes("/a%c3%a9b%7e?%", &NOT_AS_IS), "/a%C3%A9b~?%25");
        // Bytes no URI holds as they are, as routing reads them.
        assert_eq!(
            normal_escapes("/caf\u{e9}s/a|b", &NOT_AS_IS_IN_PATH),
            "/caf%C3%A9s/a%7Cb"
        );
        assert_eq!(
            normal_escapes("x={\"a b\"}^`<>\\", &NOT_AS_IS),
            "x=%7B%22a%20b%22%7D%5E%60%3C%3E%5C"
        );
        assert_eq!(normal_escapes("\u{1F600}%e9", &NOT_AS_IS), "%F0%9F%98%80%E9");
        assert!(matches!(
            normal_escapes("a+b;c=d,e[f]!$&'()*:@/?", &NOT_AS_IS),
            Cow::Borrowed(_)
        ));
        // In a path `[` and `]` are escaped too, as routing escapes them.
        assert_eq!(normal_escapes("/m/a[1]", &NOT_AS_IS_IN_PATH), "/m/a%5B1%5D");
        for b in 0..=255u8 {
            let escaped = NOT_AS_IS_IN_PATH[usize::from(b)] || matches!(b, b'%' | b'?' | b'#');
            assert_eq!(escaped, !crate::config::PATH_AS_IS[usize::from(b)], "{b:#x}");
        }
        assert_eq!(normal_escapes("%%32%35%", &NOT_AS_IS), "%2525%25");
        assert!(matches!(
            normal_escapes("/v1/orders?ref=a%C3%A9", &NOT_AS_IS),
            Cow::Borrowed(_)
        ));
    }

    /// A listed header sent on two lines is fingerprinted as the one line
    /// a proxy on the way may join them into, and the order of the lines
    /// counts.
    #[test]
    fn a_headers_lines_are_fingerprinted_as_one_value() {
        let policy = FingerprintPolicy {
            headers: vec![http::HeaderName::from_static("x-flags")],
            body: BodyMode::None,
            ignore: Vec::new(),
        };
        let print = |lines: &[&'static str]| {
            let mut request = http::Request::post("/v1/orders");
            for &line in lines {
                request = request.header("x-flags", line);
            }
            let (parts, ()) = request.body(()).unwrap().into_parts();
            fingerprint(&policy, None, &parts, &Bytes::new(), None)
        };
        assert_eq!(print(&["a", "b"]), print(&["a,b"]));
        assert_ne!(print(&["a", "b"]), print(&["b", "a"]));
        assert_ne!(print(&["a,b"]), print(&[]));
        assert_ne!(print(&[""]), print(&[]));
    }
}
