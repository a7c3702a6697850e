//! Step 1 and 2 of the pipeline: the idempotency key (read from its header
//! or derived from an allow-list of request fields) and the record key it is
//! stored under (scoped by the configured headers).

use std::borrow::Cow;

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use super::canonical::{self, Json};
use super::problem::Problem;
use crate::config::{DeriveField, KeyPolicy, RouteMatch};
use crate::store::RecordKey;

/// The request parts a derived key may read.
pub struct KeySource<'a> {
    pub route: &'a str,
    pub headers: &'a HeaderMap,
    pub query: Option<&'a str>,
    pub params: &'a RouteMatch,
    /// The body parsed as JSON, when the body is JSON.
    pub json: Option<&'a Json>,
}

/// Reads the key header. `Ok(None)` when it is absent.
pub fn from_header(policy: &KeyPolicy, headers: &HeaderMap) -> Result<Option<String>, Problem> {
    let mut values = headers.get_all(&policy.header).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let name = &policy.header;
    if values.next().is_some() {
        return Err(Problem::KeyInvalid(format!("the {name} header must be sent once")));
    }
    let key = parse(value.as_bytes()).ok_or_else(|| {
        Problem::KeyInvalid(format!(
            "the {name} header must be a token or a quoted string of visible ASCII"
        ))
    })?;
    if key.is_empty() {
        return Err(Problem::KeyInvalid(format!("the {name} header is empty")));
    }
    if key.len() > policy.max_length {
        return Err(Problem::KeyInvalid(format!(
            "the {name} header is longer than {} characters",
            policy.max_length
        )));
    }
    Ok(Some(key))
}

/// A plain token or an RFC 8941 sf-string; the key is the inner text, which
/// must be visible ASCII.
pub(crate) fn parse(raw: &[u8]) -> Option<String> {
    let visible = |b: u8| (0x21..=0x7e).contains(&b);
    let Some(quoted) = raw.strip_prefix(b"\"") else {
        // Visible ASCII is UTF-8: the check cannot fail.
        return raw
            .iter()
            .all(|&b| visible(b))
            .then(|| String::from_utf8(raw.to_vec()).ok())
            .flatten();
    };
    let inner = quoted.strip_suffix(b"\"")?;
    let mut key = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => key.push(e),
                _ => return None,
            },
            b'"' => return None,
            b if visible(b) => key.push(b),
            _ => return None,
        }
    }
    String::from_utf8(key).ok()
}

/// Derives a key from exactly the listed fields: SHA-256 over the route name
/// and the canonical (field, value) pairs, in the fields' sorted order.
pub fn derive(fields: &[DeriveField], source: &KeySource<'_>) -> Result<String, Problem> {
    let mut pairs = Vec::with_capacity(fields.len());
    for field in fields {
        let value = match field {
            DeriveField::Body(pointer) => source
                .json
                .and_then(|json| json.pointer(pointer))
                .map(|v| String::from_utf8(canonical::to_vec(v)).expect("canonical JSON is UTF-8"))
                .map(Json::String),
            DeriveField::Header(name) => {
                // UTF-8, not only visible ASCII: `x-tenant: Müller` is a
                // value, not an absent field. Other bytes are refused:
                // left out, two requests that differ only in them would
                // share a key.
                let values = source.headers.get_all(name).iter();
                let values = values.map(|v| String::from_utf8(identity(name, v.as_bytes()).into_owned()));
                let values: Vec<String> = values.collect::<Result<_, _>>().map_err(|_| {
                    Problem::KeyInvalid(format!(
                        "the key is derived from `{field}`, whose value is not UTF-8 text"
                    ))
                })?;
                (!values.is_empty()).then(|| Json::String(values.join(",")))
            }
            DeriveField::Path(param) => source.params.param(param).map(|v| Json::String(v.to_string())),
            DeriveField::Query(name) => {
                let mut values = query_values(source.query.unwrap_or(""), name).ok_or_else(|| {
                    Problem::KeyInvalid(format!(
                        "the key is derived from `{field}`, whose value is not UTF-8 text once decoded"
                    ))
                })?;
                // One value as itself; repeated ones as a list, so that
                // `?ref=a&ref=b` is not `?ref=a,b` (header lines, which
                // HTTP takes as one comma list, are joined).
                match values.len() {
                    0 => None,
                    1 => values.pop(),
                    _ => Some(Json::Array(values)),
                }
            }
        };
        let value = value.ok_or_else(|| match field {
            DeriveField::Body(_) if source.json.is_none() => Problem::KeyMissing(format!(
                "the key is derived from `{field}`, and the body is not JSON (or an object in it names a member \
                 twice, it nests deeper than 128 levels, or it holds a number past a double's range)"
            )),
            _ => Problem::KeyMissing(format!("the key is derived from `{field}`, which this request lacks")),
        })?;
        pairs.push(Json::Array(vec![Json::String(field.to_string()), value]));
    }
    let mut hasher = Sha256::new();
    hasher.update(b"idemgate-derived-v1\0");
    hasher.update(source.route.as_bytes());
    hasher.update(b"\0");
    hasher.update(canonical::to_vec(&Json::Array(pairs)));
    Ok(hex::encode(hasher.finalize()))
}

/// A header's value as a key, a scope or a fingerprint reads it: as sent,
/// but for `Host`, whose name is one name however it is spelled: without
/// regard to case, and without a fully qualified name's trailing dot
/// (`API.Example.com.:8080` is `api.example.com:8080`), as routes match
/// it. The port stays: another port may be another service. An empty one
/// is none (RFC 3986 §6.2.3: `api.example.com:` is `api.example.com`).
pub fn identity<'a>(name: &HeaderName, value: &'a [u8]) -> Cow<'a, [u8]> {
    if name != http::header::HOST {
        return Cow::Borrowed(value);
    }
    let host_end = match value.iter().rposition(|&b| b == b':') {
        // `[::1]` has colons but no port.
        Some(colon) if value[colon + 1..].iter().all(u8::is_ascii_digit) => colon,
        _ => value.len(),
    };
    let port = match &value[host_end..] {
        b":" => &[][..],
        port => port,
    };
    // Every trailing dot, as routes drop them (`api.example.com..` too).
    let mut name_end = host_end;
    while name_end > 1 && value[name_end - 1] == b'.' {
        name_end -= 1;
    }
    if name_end + port.len() == value.len() && !value.iter().any(u8::is_ascii_uppercase) {
        return Cow::Borrowed(value);
    }
    let host = &value[..name_end];
    let mut normal = Vec::with_capacity(value.len());
    normal.extend(host.iter().map(u8::to_ascii_lowercase));
    normal.extend_from_slice(port);
    Cow::Owned(normal)
}

/// The record key: SHA-256 over the scope headers' values (each header's
/// lines joined, [`hash_lines`]) and the key, each length-prefixed so no
/// two different inputs run together.
pub fn record_key(scope: &[HeaderName], headers: &HeaderMap, key: &str) -> RecordKey {
    let values = scope
        .iter()
        .map(|name| headers.get_all(name).iter().map(|v| identity(name, v.as_bytes())));
    record_key_of(values, key)
}

/// The record key from the values of each scope header, in scope order
/// (an empty list: the header was absent), each read by [`identity`]
/// already.
pub fn record_key_of<V>(scope: impl Iterator<Item = V>, key: &str) -> RecordKey
where
    V: Iterator<Item: AsRef<[u8]>>,
{
    let mut hasher = Sha256::new();
    hasher.update(b"idemgate-record-v1");
    for values in scope {
        if !hash_lines(&mut hasher, &[1u8], values) {
            hasher.update([0u8]);
        }
        hasher.update([2u8]);
    }
    hasher.update((key.len() as u64).to_be_bytes());
    hasher.update(key.as_bytes());
    RecordKey(hasher.finalize().into())
}

/// Hashes the lines of one header as one value, `tag`, its length and
/// the lines joined by ",", as a derived key reads them; `false`, hashing
/// nothing, when there are none. A field's lines are one comma list (RFC
/// 9110 §5.3), and a proxy on the way may join them (Envoy does, with
/// ","): a retry that reaches idemgate so joined must find the record its
/// first try made. One line hashes as it always has.
pub(crate) fn hash_lines<V: AsRef<[u8]>>(hasher: &mut Sha256, tag: &[u8], mut lines: impl Iterator<Item = V>) -> bool {
    let Some(first) = lines.next() else {
        return false;
    };
    // Empty, and so not allocated, for the one line nearly every field has.
    let rest: Vec<V> = lines.collect();
    let len = first.as_ref().len() + rest.iter().map(|line| 1 + line.as_ref().len()).sum::<usize>();
    hasher.update(tag);
    hasher.update((len as u64).to_be_bytes());
    hasher.update(first.as_ref());
    for line in &rest {
        hasher.update(b",");
        hasher.update(line.as_ref());
    }
    true
}

/// The values of the query's `name` fields, decoded as a form's are
/// ([`crate::wire::form_decoded`]); `None` when one is not UTF-8 once
/// decoded, so that `?ref=%FF` and `?ref=%FE` cannot derive one key.
fn query_values(query: &str, name: &str) -> Option<Vec<Json>> {
    let decode = |text: &str| String::from_utf8(crate::wire::form_decoded(text));
    let mut values = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (field, value) = pair.split_once('=').unwrap_or((pair, ""));
        if decode(field).is_ok_and(|field| field == name) {
            values.push(Json::String(decode(value).ok()?));
        }
    }
    Some(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_read_without_case_or_trailing_dot_and_other_fields_as_sent() {
        let host = |value: &str| String::from_utf8(identity(&http::header::HOST, value.as_bytes()).into_owned());
        for (sent, read) in [
            ("api.example.com", "api.example.com"),
            ("API.Example.com.", "api.example.com"),
            ("API.Example.com.:8443", "api.example.com:8443"),
            ("api.example.com..", "api.example.com"),
            ("api.example.com:", "api.example.com"),
            ("API.example.com.:", "api.example.com"),
            ("[::1]", "[::1]"),
            ("[::1]:", "[::1]"),
            ("[::1]:80", "[::1]:80"),
            ("[FE80::1]", "[fe80::1]"),
            (".", "."),
            ("", ""),
        ] {
            assert_eq!(host(sent).unwrap(), read, "{sent}");
        }
        let tenant = HeaderName::from_static("x-tenant");
        assert_eq!(identity(&tenant, b"Acme."), &b"Acme."[..]);
    }

    /// The key `fields` derive from a request with `headers` and `query`.
    fn derived(fields: &[DeriveField], headers: &HeaderMap, query: Option<&str>) -> Result<String, Problem> {
        let params = RouteMatch { params: Vec::new() };
        let source = KeySource {
            route: "r",
            headers,
            query,
            params: &params,
            json: None,
        };
        derive(fields, &source)
    }

    /// A body field is missing from a body that is not JSON for that
    /// reason, which the answer says; and from JSON that lacks it, for
    /// its own. Numbers of different values derive different keys.
    #[test]
    fn a_body_field_is_looked_for_in_json_alone() {
        let fields = [DeriveField::Body("/id".into())];
        let params = RouteMatch { params: Vec::new() };
        let key = |json: Option<&Json>| {
            let (headers, query) = (HeaderMap::new(), None);
            let source = KeySource {
                route: "r",
                headers: &headers,
                query,
                params: &params,
                json,
            };
            derive(&fields, &source)
        };
        let Err(Problem::KeyMissing(not_json)) = key(None) else {
            panic!()
        };
        assert!(not_json.contains("the body is not JSON"), "{not_json}");
        let Err(Problem::KeyMissing(lacks)) = key(canonical::parse(b"{}").as_ref()) else {
            panic!()
        };
        assert!(lacks.contains("which this request lacks"), "{lacks}");
        let one = key(canonical::parse(br#"{"id":100000000000000000001}"#).as_ref()).unwrap();
        let other = key(canonical::parse(br#"{"id":100000000000000000002}"#).as_ref()).unwrap();
        assert_ne!(one, other);
    }

    /// Record keys are stored: one computed differently after an upgrade
    /// sends a retry of a stored request to the backend again. A scope
    /// header's lines are its one value joined, and one line (or none)
    /// gives the key every version so far has given.
    #[test]
    fn a_scope_headers_lines_are_one_value_and_record_keys_are_those_of_earlier_versions() {
        let scope = [http::header::AUTHORIZATION, HeaderName::from_static("x-tenant")];
        let key = |lines: &[(&'static str, &'static str)]| {
            let mut headers = HeaderMap::new();
            for &(name, value) in lines {
                headers.append(name, http::HeaderValue::from_static(value));
            }
            let key = record_key(&scope, &headers, "k1");
            key.0.iter().map(|b| format!("{b:02x}")).collect::<String>()
        };
        // Worked out by hand from the format (Python's hashlib): tag 1,
        // length and value, or 0 when absent, then 2, for each header.
        assert_eq!(
            key(&[("authorization", "Bearer t")]),
            "54be648a73ff718e091869092fee04e8f55e2f217f5ce6cabd5d216663c70bbc"
        );
        let joined = key(&[("authorization", "Bearer t"), ("x-tenant", "a,b")]);
        assert_eq!(
            joined,
            key(&[("authorization", "Bearer t"), ("x-tenant", "a"), ("x-tenant", "b")])
        );
        assert_ne!(
            joined,
            key(&[("authorization", "Bearer t"), ("x-tenant", "b"), ("x-tenant", "a")])
        );
        assert_ne!(joined, key(&[("authorization", "Bearer t"), ("x-tenant", "a, b")]));
        // Present but empty is not absent.
        assert_ne!(
            key(&[("authorization", "Bearer t"), ("x-tenant", "")]),
            key(&[("authorization", "Bearer t")])
        );
    }

    #[test]
    fn a_repeated_query_field_is_not_its_values_joined() {
        let fields = [DeriveField::Query("ref".into())];
        let key = |query| derived(&fields, &HeaderMap::new(), Some(query)).unwrap();
        assert_ne!(key("ref=a&ref=b"), key("ref=a,b"));
        assert_eq!(key("ref=a&x=1"), key("x=2&ref=a"));
    }

    #[test]
    fn a_query_field_is_decoded_whole_or_refused() {
        let fields = [DeriveField::Query("ref".into())];
        let key = |query| derived(&fields, &HeaderMap::new(), Some(query));
        assert_eq!(key("ref=a+b%C3%BC").unwrap(), key("ref=a%20b\u{fc}").unwrap());
        assert_eq!(key("r%65f=x&ref").unwrap(), key("ref=x&ref=").unwrap());
        // Bytes that are not UTF-8: refused, not turned into U+FFFD, which
        // would give `%FF` and `%FE` one key.
        for bad in ["ref=%FF", "ref=a&ref=%FE"] {
            assert!(matches!(key(bad), Err(Problem::KeyInvalid(_))), "{bad}");
        }
        // Only the derived field's own value counts.
        assert_eq!(key("x=%FF&ref=a").unwrap(), key("ref=a").unwrap());
    }

    #[test]
    fn a_header_field_may_be_any_utf_8() {
        let fields = [DeriveField::Header(http::HeaderName::from_static("x-tenant"))];
        let key = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("x-tenant", http::HeaderValue::from_bytes(value.as_bytes()).unwrap());
            derived(&fields, &headers, None)
        };
        let muller = key("Müller").expect("a UTF-8 value is a value");
        assert_ne!(muller, key("Muller").unwrap());
        // Latin-1, not UTF-8: refused rather than left out.
        let mut headers = HeaderMap::new();
        headers.append("x-tenant", http::HeaderValue::from_static("acme"));
        headers.append("x-tenant", http::HeaderValue::from_bytes(b"M\xfcller").unwrap());
        assert!(matches!(derived(&fields, &headers, None), Err(Problem::KeyInvalid(_))));
    }

    #[test]
    fn tokens_and_sf_strings_give_the_inner_text() {
        assert_eq!(parse(b"abc-123").as_deref(), Some("abc-123"));
        assert_eq!(parse(br#""abc""#).as_deref(), Some("abc"));
        assert_eq!(parse(br#""a\"b\\c""#).as_deref(), Some(r#"a"b\c"#));
        assert_eq!(parse(br#""""#).as_deref(), Some(""));
    }

    #[test]
    fn invisible_or_malformed_keys_are_refused() {
        for bad in [
            &b"a b"[..],
            b"\"a b\"",
            b"\"abc",
            b"\"a\"b\"",
            b"\"a\\x\"",
            "é".as_bytes(),
            b"a\tb",
        ] {
            assert_eq!(parse(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
