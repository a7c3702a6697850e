//! Route path patterns: exact segments, `{param}` for one segment and
//! `{*rest}` for the remainder of the path.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param(String),
    Rest(String),
}

/// A parsed `path` of a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    source: String,
    segments: Vec<Segment>,
}

/// The parameters a matching path bound, in pattern order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RouteMatch {
    pub params: Vec<(String, String)>,
}

impl RouteMatch {
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

impl PathPattern {
    /// Parses a pattern such as `/v1/orders/{id}` or `/files/{*rest}`.
    pub fn parse(source: &str) -> Result<PathPattern, String> {
        if !source.starts_with('/') {
            return Err(format!("`{source}` must start with `/`"));
        }
        let mut segments = Vec::new();
        let mut names: Vec<&str> = Vec::new();
        let parts: Vec<&str> = source[1..].split('/').collect();
        for (i, part) in parts.iter().enumerate() {
            let segment = if let Some(inner) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                let (name, rest) = match inner.strip_prefix('*') {
                    Some(name) => (name, true),
                    None => (inner, false),
                };
                if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(format!(
                        "`{source}`: parameter `{part}` needs a name of letters, digits and `_`"
                    ));
                }
                if names.contains(&name) {
                    return Err(format!("`{source}`: parameter `{name}` appears twice"));
                }
                names.push(name);
                if rest {
                    if i + 1 != parts.len() {
                        return Err(format!("`{source}`: `{part}` must be the last segment"));
                    }
                    Segment::Rest(name.to_string())
                } else {
                    Segment::Param(name.to_string())
                }
            } else {
                if part.contains(['{', '}']) {
                    return Err(format!(
                        "`{source}`: segment `{part}` mixes text and braces; a parameter is a whole segment"
                    ));
                }
                if part.contains(['?', '#']) {
                    return Err(format!("`{source}`: a path pattern has no query or fragment"));
                }
                // Normalized as request paths are, so `/v1/%6Frders` is
                // the route of `/v1/orders` rather than of nothing, and
                // written as a request must send it: `/é` is `/%C3%A9`.
                let part = encode_outside_pchar(&decode_unreserved(part));
                if matches!(&*part, "." | "..") {
                    return Err(format!(
                        "`{source}`: a path pattern has no `.` or `..` segment (request paths are matched with theirs resolved)"
                    ));
                }
                Segment::Literal(part)
            };
            segments.push(segment);
        }
        Ok(PathPattern {
            source: source.to_string(),
            segments,
        })
    }

    /// A path the pattern matches, each parameter `fill`, and a rest of
    /// the path `fill` as many times as `rest` says.
    pub fn sample(&self, fill: &str, rest: usize) -> String {
        let rest = vec![fill; rest.max(1)].join("/");
        let segments = self.segments.iter().map(|segment| match segment {
            Segment::Literal(text) => text.as_str(),
            Segment::Param(_) => fill,
            Segment::Rest(_) => &rest,
        });
        format!("/{}", segments.collect::<Vec<_>>().join("/"))
    }

    /// The first literal segment written as another router's wildcard or
    /// parameter (`*`, `files*`, `:id`), which this one matches only as
    /// that very text.
    pub fn foreign_wildcard(&self) -> Option<&str> {
        self.segments.iter().find_map(|segment| match segment {
            Segment::Literal(text) if text.ends_with('*') || text.starts_with(':') => Some(text.as_str()),
            _ => None,
        })
    }

    /// Whether the pattern names a path parameter `name`.
    pub fn has_param(&self, name: &str) -> bool {
        self.segments.iter().any(|s| match s {
            Segment::Param(n) | Segment::Rest(n) => n == name,
            Segment::Literal(_) => false,
        })
    }

    /// Matches a request path (without its query).
    pub fn matches(&self, path: &str) -> Option<RouteMatch> {
        let rest_of = path.strip_prefix('/')?;
        let mut remaining = Some(rest_of);
        let mut found = RouteMatch::default();
        for segment in &self.segments {
            let current = remaining?;
            match segment {
                Segment::Rest(name) => {
                    found.params.push((name.clone(), current.to_string()));
                    return Some(found);
                }
                Segment::Literal(_) | Segment::Param(_) => {
                    let (head, tail) = match current.split_once('/') {
                        Some((h, t)) => (h, Some(t)),
                        None => (current, None),
                    };
                    match segment {
                        Segment::Literal(lit) if lit == head => {}
                        Segment::Param(name) if !head.is_empty() => {
                            found.params.push((name.clone(), head.to_string()));
                        }
                        _ => return None,
                    }
                    remaining = tail;
                }
            }
        }
        remaining.is_none().then_some(found)
    }
}

/// `segment` with every byte a request target cannot hold as it is
/// percent-encoded, in upper case (RFC 3986 §3.3 `pchar`: unreserved
/// characters, sub-delimiters, `:`, `@` and escapes stay): the spelling a
/// request has once [`decode_unreserved`] has read it.
fn encode_outside_pchar(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = String::with_capacity(segment.len());
    for (i, &b) in bytes.iter().enumerate() {
        let escape = b == b'%'
            && bytes
                .get(i + 1..i + 3)
                .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit));
        // (A segment holds no `/`.)
        if escape || PATH_AS_IS[b as usize] {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `path` with its percent-encoded unreserved characters (letters,
/// digits, `-`, `.`, `_`, `~`) decoded and other percent-encodings in upper
/// case: RFC 3986 §6.2.2's normalizations, under which `/v1/%6Frders` is
/// `/v1/orders`; and the bytes a path may not hold as they are (raw UTF-8,
/// `|`, `{`, ... which parsers let through) percent-encoded, so `/cafés`
/// is `/caf%C3%A9s`, as a backend reads both. Routes match, and path
/// parameters are read, from it and from it with its dot segments resolved
/// ([`remove_dot_segments`]; the gateway refuses a path whose two readings
/// go to different places); the request goes upstream as it was sent.
/// Borrowed, with nothing to do, when the path has no `%` and nothing to
/// encode.
pub fn decode_unreserved(path: &str) -> std::borrow::Cow<'_, str> {
    if path.bytes().all(|b| PATH_AS_IS[b as usize]) {
        return std::borrow::Cow::Borrowed(path);
    }
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(path.len());
    let hex = |b: u8| (b as char).to_digit(16);
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let (Some(&h), Some(&l)) = (bytes.get(i + 1), bytes.get(i + 2))
            && let (Some(high), Some(low)) = (hex(h), hex(l))
        {
            let decoded = (high * 16 + low) as u8;
            if decoded.is_ascii_alphanumeric() || matches!(decoded, b'-' | b'.' | b'_' | b'~') {
                out.push(decoded);
            } else {
                out.extend_from_slice(&[b'%', h.to_ascii_uppercase(), l.to_ascii_uppercase()]);
            }
            i += 3;
        } else if bytes[i] == b'%' || PATH_AS_IS[bytes[i] as usize] {
            // A `%` that starts no escape stays, as before.
            out.push(bytes[i]);
            i += 1;
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(bytes[i] >> 4)], HEX[usize::from(bytes[i] & 15)]]);
            i += 1;
        }
    }
    // Only ASCII was written: UTF-8.
    std::borrow::Cow::Owned(String::from_utf8(out).expect("ASCII is UTF-8"))
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// The bytes a normalized path holds as they are: RFC 3986 §3.3's `pchar`
/// but for escapes (unreserved characters, sub-delimiters, `:`, `@`) and
/// `/`. Every other byte is written as an escape, or is `%`.
pub(crate) const PATH_AS_IS: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric()
            || matches!(c, b'-' | b'.' | b'_' | b'~' | b'/')
            || matches!(
                c,
                b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b';' | b'=' | b':' | b'@'
            );
        b += 1;
    }
    table
};

/// `path` (as [`decode_unreserved`] gives it) with its escaped slashes
/// (`%2F`) decoded, as a backend that decodes the path before it routes it
/// reads them (WSGI servers, nginx's locations); `None` when it has none.
pub fn slashes_decoded(path: &str) -> Option<String> {
    path.contains("%2F").then(|| path.replace("%2F", "/"))
}

/// The readings of an absolute `path` that some backend may make of it,
/// other than as written: with its `.` and `..` segments resolved
/// ([`remove_dot_segments`], first), and, when it holds `;` or `//`,
/// with each segment's `;` parameters left out (Tomcat and Jetty read
/// `/orders;jsessionid=1` as `/orders`), or runs of `/` merged (nginx's
/// `merge_slashes`, Tomcat), or both, each then with its dots resolved.
/// Empty when there is none.
pub fn as_backends_may_read(path: &str) -> Vec<String> {
    let mut readings = Vec::new();
    if let Some(resolved) = remove_dot_segments(path) {
        readings.push(resolved);
    }
    let bytes = path.as_bytes();
    let doubled = |i: usize| bytes[i] == b'/' && bytes.get(i + 1) == Some(&b'/');
    if !path.starts_with('/') || !(0..bytes.len()).any(|i| bytes[i] == b';' || doubled(i)) {
        return readings;
    }
    // Each transformed as written, and after its dots are resolved (as a
    // backend that resolves them first would: `/v1//..//orders` is
    // `/v1//orders`, then `/v1/orders`), then its dots resolved.
    let resolved_first = readings.first().cloned();
    for from in [Some(path.to_owned()), resolved_first].into_iter().flatten() {
        for (strip, merge) in [(true, false), (false, true), (true, true)] {
            let read = transformed(&from, strip, merge);
            let read = remove_dot_segments(&read).unwrap_or(read);
            if read != path && !readings.contains(&read) {
                readings.push(read);
            }
        }
    }
    readings
}

/// `path` with each segment's `;` parameters left out (`strip`), and runs
/// of `/` merged (`merge`; a trailing `/` stays).
fn transformed(path: &str, strip: bool, merge: bool) -> String {
    let segments: Vec<&str> = path[1..]
        .split('/')
        .map(|segment| {
            if strip {
                segment.split(';').next().unwrap_or_default()
            } else {
                segment
            }
        })
        .collect();
    let last = segments.len() - 1;
    let kept: Vec<&str> = segments
        .iter()
        .enumerate()
        .filter(|&(i, segment)| !merge || !segment.is_empty() || i == last)
        .map(|(_, segment)| *segment)
        .collect();
    format!("/{}", kept.join("/"))
}

/// An absolute `path` with its `.` and `..` segments resolved (RFC 3986
/// §5.2.4: `/a/./b/../c` is `/a/c`, and `..` above the root stays at the
/// root); `None` when it has none. Empty segments stay (`//` is not `/`).
pub fn remove_dot_segments(path: &str) -> Option<String> {
    let dotted = |segment: &str| segment == "." || segment == "..";
    if !path.starts_with('/') || !path.contains("/.") || !path.split('/').any(dotted) {
        return None;
    }
    let mut kept: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path[1..].split('/').collect();
    for (i, &segment) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        match segment {
            "." if last => kept.push(""),
            "." => {}
            ".." => {
                kept.pop();
                if last {
                    kept.push("");
                }
            }
            other => kept.push(other),
        }
    }
    Some(format!("/{}", kept.join("/")))
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `path` decoded, then its dot segments resolved.
    fn normalize(path: &str) -> std::borrow::Cow<'_, str> {
        let decoded = decode_unreserved(path);
        match remove_dot_segments(&decoded) {
            Some(resolved) => std::borrow::Cow::Owned(resolved),
            None => decoded,
        }
    }

    /// A literal written as text matches the request that sends it
    /// percent-encoded, as any client must (`/é` is `/%C3%A9` or `/%c3%a9`).
    #[test]
    fn literals_match_the_encoded_requests_that_spell_them() {
        for (pattern, request) in [
            ("/caf%C3%A9s/é", "/caf%c3%a9s/%C3%A9"),
            ("/a b/100%", "/a%20b/100%25"),
            ("/x/%2f", "/x/%2F"),
            ("/sub-delims/!$&'()*+,;=:@", "/sub-delims/!$&'()*+,;=:@"),
            // Sent raw (parsers let UTF-8 and some ASCII through), as a
            // backend reads them: the same path as their escapes.
            ("/cafés/a|b", "/cafés/a|b"),
            ("/caf%C3%A9s/a%7Cb", "/cafés/a|b"),
            ("/cafés/a|b", "/caf%c3%a9s/a%7cb"),
        ] {
            let pattern = PathPattern::parse(pattern).unwrap();
            assert!(pattern.matches(&normalize(request)).is_some(), "{request}");
        }
        assert!(PathPattern::parse("/é").unwrap().matches(&normalize("/e")).is_none());
    }

    #[test]
    fn paths_read_as_backends_may_read_them() {
        for (path, readings) in [
            ("/v1/orders", &[][..]),
            ("/v1/orders/", &[]),
            ("/a/./b", &["/a/b"]),
            ("/v1//orders", &["/v1/orders"]),
            ("//", &["/"]),
            ("/a;b/c;d=1/", &["/a/c/"]),
            ("/a//../b", &["/a/b", "/b"]),
            ("/a;x=/../b", &["/b"]),
            // Each of `;` and `//` on its own too: nginx merges, Jetty
            // drops parameters, Tomcat does both.
            (
                "/v1/;//../orders",
                &["/v1/;/orders", "/v1//orders", "/v1/orders", "/orders"],
            ),
            (
                "/v1//../orders;q",
                &["/v1/orders;q", "/v1/orders", "/orders;q", "/orders"],
            ),
            // Dots resolved first, then `//` merged.
            ("/v1//..//orders", &["/v1//orders", "/orders", "/v1/orders"]),
        ] {
            assert_eq!(as_backends_may_read(path), readings, "{path}");
        }
    }

    #[test]
    fn paths_normalize_as_rfc_3986_says() {
        assert!(matches!(normalize("/v1/orders"), std::borrow::Cow::Borrowed(_)));
        assert_eq!(normalize("/v1/%6Frders"), "/v1/orders");
        assert_eq!(normalize("/v1/%6f%72ders/%41-%2E_%7e"), "/v1/orders/A-._~");
        // Reserved and other characters stay encoded, their hex upper case.
        assert_eq!(normalize("/a%2fb/%20%c3%a9"), "/a%2Fb/%20%C3%A9");
        // Not an escape: left as it is.
        assert_eq!(normalize("/100%/%zz/%4"), "/100%/%zz/%4");
        assert_eq!(normalize("/é/%41"), "/%C3%A9/A");
        assert_eq!(normalize("/{x}/[y]/\\^\"`"), "/%7Bx%7D/%5By%5D/%5C%5E%22%60");
        let pattern = PathPattern::parse("/t/{id}/items").unwrap();
        let found = pattern.matches(&normalize("/%74/%31%32/items")).unwrap();
        assert_eq!(found.param("id"), Some("12"));
        // Dot segments, written or escaped, are resolved; empty ones kept.
        for (path, resolved) in [
            ("/v1/%2E%2E/admin", "/admin"),
            ("/v1/%2e%2E/%2e/admin/", "/admin/"),
            ("/a/./b/../c", "/a/c"),
            ("/a/b/..", "/a/"),
            ("/a/b/.", "/a/b/"),
            ("/..", "/"),
            ("/../../x", "/x"),
            ("/a//../b", "/a/b"),
            ("/a/..b/.c/", "/a/..b/.c/"),
            ("/a//b", "/a//b"),
        ] {
            assert_eq!(normalize(path), resolved, "{path}");
        }
        assert!(matches!(normalize("/a/..b/.c"), std::borrow::Cow::Borrowed(_)));
    }

    /// Random paths, each written plainly and with random characters
    /// escaped (in either case), normalize alike, and normalizing twice
    /// changes nothing: one request has one route and one derived key,
    /// however its client spells the path.
    #[test]
    fn any_spelling_of_a_path_normalizes_alike() {
        let mut next = crate::testing::numbers(0x2545_F491_4F6C_DD1D);
        let pieces = ["a", "Z9", "-_~", ".", "..", "", "x.y", "%2F", "%20", "é"];
        for _ in 0..3000 {
            let segments: Vec<&str> = (0..1 + next(5)).map(|_| pieces[next(pieces.len())]).collect();
            let plain = format!("/{}", segments.join("/"));
            let mut spelled = String::new();
            for c in plain.chars() {
                let unreserved = c.is_ascii_alphanumeric() || "-._~".contains(c);
                if unreserved && next(3) == 0 {
                    let escape = format!("%{:02X}", c as u32);
                    spelled.push_str(&if next(2) == 0 {
                        escape.to_ascii_lowercase()
                    } else {
                        escape
                    });
                } else {
                    spelled.push(c);
                }
            }
            let once = normalize(&plain).into_owned();
            assert_eq!(normalize(&spelled), once, "{plain} spelled {spelled}");
            assert_eq!(normalize(&once), once, "{plain}");
        }
    }

    #[test]
    fn patterns_are_normalized_as_paths_are() {
        let p = PathPattern::parse("/v1/%6frders/%2f").unwrap();
        assert!(p.matches(&normalize("/v1/orders/%2F")).is_some());
        assert!(p.matches(&normalize("/v1/%6Frders/%2f")).is_some());
        assert_eq!(p.to_string(), "/v1/%6frders/%2f", "shown as written");
    }

    #[test]
    fn exact_paths_match_only_themselves() {
        let p = PathPattern::parse("/v1/orders").unwrap();
        assert!(p.matches("/v1/orders").is_some());
        assert!(p.matches("/v1/orders/").is_none());
        assert!(p.matches("/v1/orders/7").is_none());
        assert!(p.matches("/v1").is_none());
    }

    #[test]
    fn params_bind_one_non_empty_segment() {
        let p = PathPattern::parse("/v1/orders/{id}/lines").unwrap();
        let m = p.matches("/v1/orders/42/lines").unwrap();
        assert_eq!(m.param("id"), Some("42"));
        assert!(p.matches("/v1/orders//lines").is_none());
        assert!(p.matches("/v1/orders/4/2/lines").is_none());
    }

    #[test]
    fn rest_binds_the_remainder() {
        let p = PathPattern::parse("/files/{*rest}").unwrap();
        assert_eq!(p.matches("/files/a/b/c").unwrap().param("rest"), Some("a/b/c"));
        assert_eq!(p.matches("/files/").unwrap().param("rest"), Some(""));
        assert!(p.matches("/files").is_none());
    }

    #[test]
    fn root_pattern() {
        let p = PathPattern::parse("/").unwrap();
        assert!(p.matches("/").is_some());
        assert!(p.matches("/x").is_none());
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in [
            "orders",
            "/a/{}",
            "/a/{*r}/b",
            "/a/x{id}",
            "/a/{id}/{id}",
            "/a?b",
            "/a/../b",
            "/a/.",
            "/a/%2e%2E",
        ] {
            assert!(PathPattern::parse(bad).is_err(), "{bad}");
        }
    }
}
