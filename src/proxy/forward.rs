//! The request as it goes upstream (hop-by-hop headers dropped,
//! `X-Forwarded-*` set); the client itself, which drops the response's
//! hop-by-hop headers as it reads them, is in the `upstream` module.

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use http::header::{self, Entry, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Version};
use smallvec::SmallVec;

use super::body::ClientBody;
use crate::wire::{HOP_BY_HOP, is_hop_by_hop};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Removes hop-by-hop headers, including every header `Connection` names,
/// and `Expect`: the listener answered the expectation (or had no need
/// to), the body goes without waiting, and an upstream that knows no
/// expectations would answer 417. nginx drops it too.
///
/// A head usually has none, or just `Connection: keep-alive`: one pass over
/// the names tells which, with nothing allocated, and each removal is a
/// hash and a probe.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let (mut connection, mut others, mut expect) = (false, false, false);
    for name in headers.keys() {
        if name == header::CONNECTION {
            connection = true;
        } else if name == header::EXPECT {
            expect = true;
        } else if is_hop_by_hop(name) {
            others = true;
        }
    }
    if expect {
        headers.remove(header::EXPECT);
    }
    if connection && let Entry::Occupied(entry) = headers.entry(header::CONNECTION) {
        // Its values as they are removed: one lookup.
        let values = entry.remove_entry_mult().1.collect::<SmallVec<[HeaderValue; 2]>>();
        drop_named(headers, values.iter().map(HeaderValue::as_bytes));
    }
    if others {
        for name in &HOP_BY_HOP[1..] {
            headers.remove(name);
        }
    }
}

/// Removes the headers that `Connection` `values` name (`close` and
/// `keep-alive` are options, not names).
pub fn drop_named<'a>(headers: &mut HeaderMap, values: impl Iterator<Item = &'a [u8]>) {
    for value in values {
        let tokens = crate::wire::byte_tokens(value);
        let names = tokens.filter(|t| !t.eq_ignore_ascii_case(b"close") && !t.eq_ignore_ascii_case(b"keep-alive"));
        for name in names.filter_map(|t| HeaderName::from_bytes(t).ok()) {
            headers.remove(name);
        }
    }
}

/// Gives an HTTP/2 request's headers the shape an HTTP/1.1 head would have,
/// before anything reads them, so a route's `scope`, derived key and
/// fingerprint see the same request whichever protocol a retry comes by:
/// the `Cookie` fields it may send one per cookie joined, and values
/// without the spaces or tabs around them an HTTP/1.1 parser drops (RFC
/// 9113 §8.2.1 forbids them, and HTTP/2 parsers let them through). (Its
/// `Host`, from `:authority`, is [`host_from_target`]'s.)
pub fn h2_as_h1(headers: &mut HeaderMap) {
    let blank = |b: &u8| *b == b' ' || *b == b'\t';
    for value in headers.values_mut() {
        let bytes = value.as_bytes();
        if bytes.first().is_some_and(blank) || bytes.last().is_some_and(blank) {
            let trimmed = bytes.trim_ascii();
            // A field value's part that begins and ends with a visible
            // byte is one too.
            *value = HeaderValue::from_bytes(trimmed).expect("a field value trimmed");
        }
    }
    join_cookies(headers);
}

/// Makes the target's own authority, when it names one (an absolute-form
/// target; HTTP/2's `:authority`), the request's `Host`: it wins over a
/// `Host` field (RFC 9112 §3.2.2, RFC 9113 §8.3.1), and routes match it,
/// so a route's `scope`, derived key and fingerprint must read it too, not
/// a `Host` that names another. (An HTTP/2 client may send no `Host`.)
pub fn host_from_target(uri: &Uri, headers: &mut HeaderMap) {
    if let Some(host) = authority_host(uri) {
        headers.insert(header::HOST, host);
    }
}

/// Whether an HTTP/2 request's `Host` field names another host than its
/// `:authority`: RFC 9113 §8.3.1 has a server treat it as malformed, as
/// the two may pick different routes in different hops. The same host is
/// the same name or address, in any case and with or without a fully
/// qualified name's trailing dot, on the same port, an absent one being
/// the scheme's.
pub fn host_contradicts_authority(uri: &Uri, headers: &HeaderMap) -> bool {
    let (Some(authority), true) = (uri.authority(), headers.contains_key(header::HOST)) else {
        return false;
    };
    let default = if uri.scheme() == Some(&http::uri::Scheme::HTTPS) {
        443
    } else {
        80
    };
    let same = |host: &http::uri::Authority| {
        host.host()
            .trim_end_matches('.')
            .eq_ignore_ascii_case(authority.host().trim_end_matches('.'))
            && host.port_u16().unwrap_or(default) == authority.port_u16().unwrap_or(default)
    };
    headers.get_all(header::HOST).iter().any(|host| {
        match host.to_str().ok().and_then(|h| h.parse::<http::uri::Authority>().ok()) {
            // A port that is not one (`:99999`, `:8o`, which `port_u16`
            // reads as none) names no endpoint.
            Some(host)
                if !host.as_str().contains('@')
                    && port_text(host.as_str()).is_none_or(|p| p.parse::<u16>().is_ok()) =>
            {
                !same(&host)
            }
            _ => true,
        }
    })
}

/// The port of an authority `host[:port]` as written, when it has one
/// that is not empty.
fn port_text(authority: &str) -> Option<&str> {
    let after_host = match authority.strip_prefix('[') {
        Some(literal) => &literal[literal.find(']')? + 1..],
        None => authority,
    };
    let (_, port) = after_host.rsplit_once(':')?;
    (!port.is_empty()).then_some(port)
}

/// The target's own `host[:port]` as a `Host` value, when it names one:
/// never a user or password the target named.
fn authority_host(uri: &Uri) -> Option<HeaderValue> {
    let authority = uri.authority()?.as_str();
    HeaderValue::from_str(authority.rsplit('@').next().unwrap_or_default()).ok()
}

/// Joins the `Cookie` fields an HTTP/2 client may send one per cookie into
/// one, separated by "; ", as an HTTP/1.1 hop must see them (RFC 9113
/// §8.2.3): many backends read only the first `Cookie` line, and would
/// lose the session or CSRF cookie behind it. An HTTP/1.1 client that
/// sends several lines has them joined too, so a route's `scope`, derived
/// key and fingerprint see the same request either way.
pub fn join_cookies(headers: &mut HeaderMap) {
    let Entry::Occupied(entry) = headers.entry(header::COOKIE) else {
        return;
    };
    if entry.iter().nth(1).is_none() {
        return;
    }
    let mut joined = Vec::with_capacity(entry.iter().map(|v| v.len() + 2).sum());
    for value in entry.iter() {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(value.as_bytes());
    }
    // Each value was a valid field value, and so is "; ": the whole is too.
    let joined = HeaderValue::from_bytes(&joined).expect("valid field values joined by \"; \"");
    drop(entry.remove_entry_mult());
    headers.insert(header::COOKIE, joined);
}

/// How the client reached idemgate, for `X-Forwarded-*`.
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    pub tls: bool,
}

/// Points `request` at `upstream` and rewrites its headers for the hop.
pub fn prepare(request: &mut Request<ClientBody>, upstream: &Uri, peer: Peer) {
    // The Host of the upstream, as nginx's default `proxy_set_header Host
    // $proxy_host`; the client's travels in X-Forwarded-Host: the target's
    // own authority when it has one (absolute-form, HTTP/2's :authority),
    // which wins over Host (RFC 9112 §3.2.2), else Host.
    let sent_host = request.headers_mut().remove(header::HOST);
    let original_host = authority_host(request.uri()).or(sent_host);
    let path = request
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let mut parts = upstream.clone().into_parts();
    parts.path_and_query = Some(path);
    *request.uri_mut() = Uri::from_parts(parts).expect("an upstream URL plus a request path is a URI");
    // An HTTP/2 request's cookies were joined as it arrived (`h2_as_h1`).
    *request.version_mut() = Version::HTTP_11;

    let headers = request.headers_mut();
    strip_hop_by_hop(headers);
    drop_forwarded_look_alikes(headers);
    // Every earlier hop, from every X-Forwarded-For line, then this client;
    // one lookup of the name whether it is there or not.
    let entry = headers.entry(X_FORWARDED_FOR.clone());
    let value = match &entry {
        // As bytes: a line with bytes past ASCII (obs-text) is passed on
        // as it came, not dropped.
        Entry::Occupied(earlier) => {
            let mut forwarded_for = Vec::with_capacity(64);
            let earlier = earlier.iter().map(|v| v.as_bytes().trim_ascii());
            for hop in earlier.filter(|v| !v.is_empty()) {
                forwarded_for.extend_from_slice(hop);
                forwarded_for.extend_from_slice(b", ");
            }
            let mut client = String::with_capacity(39);
            push_ip(&mut client, peer.addr.ip());
            forwarded_for.extend_from_slice(client.as_bytes());
            HeaderValue::from_bytes(&forwarded_for)
        }
        Entry::Vacant(_) => Ok(client_address(peer.addr.ip())),
    };
    match (entry, value) {
        // `insert`, not `insert_mult`: http 1.5 panics draining three or more
        // values through `insert_mult`.
        (Entry::Occupied(mut entry), Ok(value)) => drop(entry.insert(value)),
        (Entry::Occupied(entry), Err(_)) => drop(entry.remove_entry_mult()),
        (Entry::Vacant(entry), Ok(value)) => drop(entry.insert(value)),
        (Entry::Vacant(_), Err(_)) => {}
    }
    headers.insert(
        X_FORWARDED_PROTO.clone(),
        HeaderValue::from_static(if peer.tls { "https" } else { "http" }),
    );
    match original_host {
        Some(host) => headers.insert(X_FORWARDED_HOST.clone(), host),
        None => headers.remove(&X_FORWARDED_HOST),
    };
}

/// Removes the look-alikes of the headers set here (`X_Forwarded_For`,
/// `x-forwarded_host`, ...): CGI and WSGI read `_` as `-`, so a backend
/// behind one would take the client's value for idemgate's. (nginx drops
/// every name with `_`; other names pass here, as they did.)
fn drop_forwarded_look_alikes(headers: &mut HeaderMap) {
    let forwarded = [&X_FORWARDED_FOR, &X_FORWARDED_PROTO, &X_FORWARDED_HOST];
    let look_alike = |name: &HeaderName| {
        let name = name.as_str().as_bytes();
        name.contains(&b'_')
            && forwarded.iter().any(|set| {
                let set = set.as_str().as_bytes();
                set.len() == name.len() && set.iter().zip(name).all(|(s, n)| s == n || (*s == b'-' && *n == b'_'))
            })
    };
    // Inline: nothing is allocated when there are none, as nearly always.
    let found: SmallVec<[HeaderName; 2]> = headers.keys().filter(|n| look_alike(n)).cloned().collect();
    for name in found {
        headers.remove(name);
    }
}

/// `ip` as a header value, kept per thread for the next request from the
/// same address (most come from a few: a load balancer, a sidecar), whose
/// value is then a reference count rather than a new string.
fn client_address(ip: IpAddr) -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(IpAddr, HeaderValue)>> = const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| {
        if let Some((seen, value)) = last
            && *seen == ip
        {
            return value.clone();
        }
        let mut text = String::with_capacity(15);
        push_ip(&mut text, ip);
        let value = HeaderValue::from_str(&text).expect("an address is a valid header value");
        *last = Some((ip, value.clone()));
        value
    })
}

/// Appends `ip` as text; an IPv4 address, the common case, without the
/// formatting machinery.
fn push_ip(text: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    text.push('.');
                }
                if octet >= 100 {
                    text.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    text.push(char::from(b'0' + octet / 10 % 10));
                }
                text.push(char::from(b'0' + octet % 10));
            }
        }
        IpAddr::V6(v6) => {
            let _ = write!(text, "{v6}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_named_headers_go_too() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn a_named_header_goes_even_when_connection_is_the_only_hop_by_hop_one() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty());
        let mut h = HeaderMap::new();
        h.insert(header::TRAILER, HeaderValue::from_static("x-sum"));
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty());
        let mut h = HeaderMap::new();
        h.append(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        h.append(header::CONNECTION, HeaderValue::from_static("x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().collect::<Vec<_>>(), ["x-kept"]);
    }

    #[test]
    fn an_http2_request_takes_its_http1_shape() {
        let cookies = |headers: &HeaderMap| {
            let values = headers.get_all(header::COOKIE).iter();
            values.map(|v| v.to_str().unwrap().to_owned()).collect::<Vec<_>>()
        };
        let mut headers = HeaderMap::new();
        for cookie in ["session=abc", "csrf=xyz", "theme=dark"] {
            headers.append(header::COOKIE, HeaderValue::from_static(cookie));
        }
        h2_as_h1(&mut headers);
        assert_eq!(cookies(&headers), ["session=abc; csrf=xyz; theme=dark"]);
        let mut none = HeaderMap::new();
        none.insert(header::COOKIE, HeaderValue::from_static("one=1"));
        h2_as_h1(&mut none);
        assert_eq!(cookies(&none), ["one=1"]);
        // Values as an HTTP/1.1 parser reads them: without blanks around.
        let mut blanks = HeaderMap::new();
        for (name, value) in [
            ("authorization", "Bearer z "),
            ("x-a", "\t a b"),
            ("x-a", "  "),
            ("x-b", "c"),
        ] {
            blanks.append(name, HeaderValue::from_static(value));
        }
        h2_as_h1(&mut blanks);
        let values = blanks.iter().map(|(n, v)| (n.as_str(), v.to_str().unwrap()));
        assert_eq!(
            values.collect::<Vec<_>>(),
            [("authorization", "Bearer z"), ("x-a", "a b"), ("x-a", ""), ("x-b", "c")]
        );
    }

    #[test]
    fn the_target_names_the_host() {
        let mut headers = HeaderMap::new();
        host_from_target(
            &Uri::from_static("https://user:pw@api.example.com:8443/orders"),
            &mut headers,
        );
        assert_eq!(headers[header::HOST], "api.example.com:8443");
        // A Host the client sent gives way to the target's; without an
        // authority, it stands (and so does its absence).
        let mut sent = HeaderMap::new();
        sent.insert(header::HOST, HeaderValue::from_static("sent.example"));
        host_from_target(&Uri::from_static("http://api.example.com/orders"), &mut sent);
        assert_eq!(sent[header::HOST], "api.example.com");
        host_from_target(&Uri::from_static("/orders"), &mut sent);
        assert_eq!(sent[header::HOST], "api.example.com");
        let mut none = HeaderMap::new();
        host_from_target(&Uri::from_static("/orders"), &mut none);
        assert_eq!(none.get(header::HOST), None);
    }

    #[test]
    fn addresses_are_written_as_std_writes_them() {
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "10.20.30.40",
            "255.255.255.255",
            "1.100.9.99",
            "::1",
            "2001:db8::7",
        ] {
            let mut text = String::from("x, ");
            push_ip(&mut text, ip.parse().unwrap());
            assert_eq!(text, format!("x, {ip}"));
        }
    }
}
