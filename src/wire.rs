//! HTTP/1.1 framing shared by the listener (`server::h1`) and the upstream
//! client (`proxy::upstream`): head limits, when a head being read is worth
//! parsing again, a parsed head's headers cut into a header map with the
//! notes its framing reads, the chunked coding,
//! numbers written without the formatting machinery, interned header
//! names; and a query field decoded as a form's.

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http_body::Frame;
use smallvec::SmallVec;

/// The largest head (start line and headers) accepted, and the largest
/// trailer section.
pub const MAX_HEAD: usize = 64 * 1024;
/// The most header fields a head may have.
pub const MAX_HEADERS: usize = 128;

/// The longest chunk-size line (size and extensions, without its CRLF).
const MAX_SIZE_LINE: usize = 1024;

/// Where a chunked body is.
pub enum Chunked {
    Size,
    Data(u64),
    DataEnd,
    /// The trailers so far, how many bytes of them, and how much of the
    /// line being read was looked at already (its end not among it).
    Trailers(HeaderMap, usize, usize),
    Done,
}

/// Tells when a head being read (a request's by the listener, an answer's
/// by the upstream client) is worth parsing again: only once a line has
/// ended since the last look (a head is complete only at a line's end, and
/// a bad line is refused at its end), or a byte came that no head may hold
/// (a control character, or a CR that no LF follows), which httparse
/// refuses wherever it stands in the head, so the head is answered as it
/// would be read whole. Parsing after every read instead let a peer that
/// sends a 64 KiB head a byte at a time make idemgate scan ~2 GB. With
/// the empty lines before a head dropped first ([`LineWatch::skip_empty_lines`]), a
/// head is parsed at most once a line, `MAX_HEADERS` + 2 times, and once
/// more for a byte that ends it.
#[derive(Default)]
pub struct LineWatch {
    /// How much of the buffer has been looked at.
    seen: usize,
}

impl LineWatch {
    /// True at the first look (most heads arrive whole in one read), then
    /// when the bytes read since hold an LF or another control character
    /// but HTAB and CR, or a CR followed by another byte (the last one
    /// looked at may be that CR).
    pub fn ended_another(&mut self, buf: &[u8]) -> bool {
        let first = self.seen == 0;
        let new = buf.get(self.seen..).unwrap_or_default();
        let from_last = buf.get(self.seen.saturating_sub(1)..).unwrap_or_default();
        self.seen = buf.len();
        first
            || new.iter().any(|&b| (b < 0x20 && b != b'\t' && b != b'\r') || b == 0x7f)
            || from_last.windows(2).any(|w| w[0] == b'\r' && w[1] != b'\n')
    }

    /// Drops the empty lines (CRLF, or a bare LF) at the front of `buf`,
    /// which a head may follow (RFC 9112 §2.2; httparse skips them too),
    /// and looks at what is left afresh if it dropped any. A CR alone at
    /// the end stays, its LF yet to come. Dropped as they come, a flood of
    /// them is never parsed over and over.
    pub fn skip_empty_lines(&mut self, buf: &mut BytesMut) {
        let mut n = 0;
        loop {
            match &buf[n..] {
                [b'\r', b'\n', ..] => n += 2,
                [b'\n', ..] => n += 1,
                _ => break,
            }
        }
        if n > 0 {
            buf.advance(n);
            self.seen = 0;
        }
    }
}

/// The next frame of a chunked body in `buf`, if it holds one; `None` when
/// more bytes are needed or the body is done (the state says which).
pub fn next_chunk(state: &mut Chunked, buf: &mut BytesMut) -> Result<Option<Frame<Bytes>>, &'static str> {
    let bad = || "the chunked body is malformed";
    loop {
        match state {
            Chunked::Size => {
                // A size line (extensions and all) of at most 1 KiB, whole or
                // not: each chunk's data is a slice of the read buffer, so a
                // long line before each one-byte chunk would have every byte
                // of body hold a buffer's worth of memory.
                let end = match line_end(buf) {
                    Some(end) if end <= MAX_SIZE_LINE => end,
                    Some(_) => return Err(bad()),
                    // (Its CR may be in, its LF not yet.)
                    None if buf.len() > MAX_SIZE_LINE + 1 || bare_cr_or_lf(buf) => return Err(bad()),
                    None => return Ok(None),
                };
                let size = chunk_size(&buf[..end]).ok_or_else(bad)?;
                buf.advance(end + 2);
                *state = if size == 0 {
                    Chunked::Trailers(HeaderMap::new(), 0, 0)
                } else {
                    Chunked::Data(size)
                };
            }
            Chunked::Data(left) => {
                if buf.is_empty() {
                    return Ok(None);
                }
                let n = (*left).min(buf.len() as u64);
                *left -= n;
                let data = buf.split_to(n as usize).freeze();
                if *left == 0 {
                    *state = Chunked::DataEnd;
                }
                return Ok(Some(Frame::data(data)));
            }
            Chunked::DataEnd => {
                if buf.len() < 2 {
                    // A lone byte that is not the CR: refused now, not
                    // once a second byte comes (or never does).
                    return if buf.first().is_some_and(|&b| b != b'\r') {
                        Err(bad())
                    } else {
                        Ok(None)
                    };
                }
                if &buf[..2] != b"\r\n" {
                    return Err(bad());
                }
                buf.advance(2);
                *state = Chunked::Size;
            }
            Chunked::Trailers(trailers, size, seen) => {
                // Where the last look stopped, less its last byte (a CR whose
                // LF had not come): a line sent a byte at a time is looked
                // over once, not once per byte.
                let from = seen.saturating_sub(1).min(buf.len());
                let Some(end) = line_end(&buf[from..]).map(|end| from + end) else {
                    *seen = buf.len();
                    return if *size + buf.len() > MAX_HEAD || bare_cr_or_lf(&buf[from..]) {
                        Err(bad())
                    } else {
                        Ok(None)
                    };
                };
                *seen = 0;
                *size += end + 2;
                if *size > MAX_HEAD {
                    return Err("the trailers are too large");
                }
                if end == 0 {
                    buf.advance(2);
                    let trailers = std::mem::take(trailers);
                    *state = Chunked::Done;
                    return Ok((!trailers.is_empty()).then(|| Frame::trailers(trailers)));
                }
                if trailers.len() >= MAX_HEADERS {
                    return Err("the trailers are too large");
                }
                let line = buf.split_to(end + 2).freeze();
                let colon = line.iter().position(|b| *b == b':').ok_or_else(bad)?;
                let name = HeaderName::from_bytes(&line[..colon]).map_err(|_| bad())?;
                // Optional whitespace is spaces and tabs only (RFC 9110
                // §5.6.3): a bare CR or LF is refused, never trimmed away.
                let blank = |b: &u8| *b == b' ' || *b == b'\t';
                let value = &line[colon + 1..end];
                let start = value.iter().take_while(|b| blank(b)).count();
                let stop = value.len() - value[start..].iter().rev().take_while(|b| blank(b)).count();
                let value = HeaderValue::from_bytes(&value[start..stop]).map_err(|_| bad())?;
                trailers.try_append(name, value).map_err(|_| bad())?;
            }
            Chunked::Done => return Ok(None),
        }
    }
}

/// The size of a chunk-size line (without its CRLF), read strictly
/// (RFC 9112 §7.1): hex digits, optional blanks, then nothing or an
/// extension; no control characters anywhere, so a bare CR or LF never
/// ends a line here that another parser would end elsewhere.
fn chunk_size(line: &[u8]) -> Option<u64> {
    if line.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        return None;
    }
    let hex = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    // Leading zeros are allowed, any number of them; the rest must fit.
    let zeros = line[..hex]
        .iter()
        .take_while(|&&b| b == b'0')
        .count()
        .min(hex.saturating_sub(1));
    if hex == 0 || hex - zeros > 16 {
        return None;
    }
    let rest = line[hex..].trim_ascii_start();
    if !(rest.is_empty() || rest[0] == b';') {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(&line[zeros..hex]).ok()?, 16).ok()
}

/// The comma-separated tokens of every `name` field, trimmed, empty ones
/// skipped.
pub fn tokens(headers: &HeaderMap, name: HeaderName) -> impl DoubleEndedIterator<Item = &str> {
    headers.get_all(name).into_iter().flat_map(value_tokens)
}

/// The comma-separated tokens of one field value, trimmed, empty ones
/// skipped; a value that is not text has none.
fn value_tokens(value: &HeaderValue) -> impl DoubleEndedIterator<Item = &str> {
    value
        .to_str()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// Where each header of a parsed head lies in its buffer: name start, name
/// end, value start, value end (a head is at most a few times `MAX_HEAD`
/// long, far below `u32::MAX`). Inline up to the usual number of headers:
/// no zeroed `MAX_HEADERS` array, no allocation.
pub type HeaderOffsets = SmallVec<[(u32, u32, u32, u32); 16]>;

/// The offsets of `parsed`'s headers in `buf`, which they were parsed from:
/// taken before the head is split off the buffer, so that its headers can
/// then be cut from it without a copy (see [`append_headers`]).
pub fn header_offsets(buf: &[u8], parsed: &[httparse::Header<'_>]) -> HeaderOffsets {
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| (s.as_ptr() as usize - base) as u32;
    parsed
        .iter()
        .map(|h| {
            let (name, value) = (h.name.as_bytes(), h.value);
            (
                at(name),
                at(name) + name.len() as u32,
                at(value),
                at(value) + value.len() as u32,
            )
        })
        .collect()
}

/// A header of a head that `http` refuses.
pub enum BadHeader {
    Name,
    Value,
}

/// A query's field name or value decoded as a form's are (`+` a space,
/// then `%XX` escapes), to bytes: not `form_urlencoded::parse`, which turns
/// bytes that are not UTF-8 into U+FFFD, so that `%FF` and `%FE` would read
/// alike.
pub fn form_decoded(text: &str) -> Vec<u8> {
    percent_encoding::percent_decode_str(&text.replace('+', " ")).collect()
}

/// The comma-separated tokens of a field value, as bytes, trimmed, empty
/// ones skipped: a token beside bytes that are not text (obs-text) is
/// still read, so `Connection: x-secret, \xe9` still names `x-secret`.
pub fn byte_tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus their common non-standard kin.
pub static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Whether `name` is one of [`HOP_BY_HOP`]: most names are told apart by
/// their length alone.
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(name.as_str().len(), 2 | 7 | 10 | 16..=19) && HOP_BY_HOP.contains(name)
}

/// Which headers of a head [`append_headers`] leaves out of the map.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    All,
    /// All but the hop-by-hop ones, except `Transfer-Encoding`, which the
    /// framing reads (and the caller then drops). A header that
    /// `Connection` names is still appended: see [`Noted::connection_names`].
    EndToEnd,
}

/// Appends the headers at `offsets` in `head` to `headers`, names interned
/// and values cut from `head`, and returns the notes its framing reads.
pub fn append_headers(
    head: &Bytes,
    offsets: &HeaderOffsets,
    headers: &mut HeaderMap,
    keep: Keep,
) -> Result<Noted, BadHeader> {
    let mut noted = Noted::default();
    for &(name_start, name_end, start, end) in offsets {
        let name = names::intern(&head[name_start as usize..name_end as usize]).map_err(|_| BadHeader::Name)?;
        let value =
            HeaderValue::from_maybe_shared(head.slice(start as usize..end as usize)).map_err(|_| BadHeader::Value)?;
        noted.note(&name, &value);
        if keep == Keep::EndToEnd && name != header::TRANSFER_ENCODING && is_hop_by_hop(&name) {
            continue;
        }
        headers.append(name, value);
    }
    Ok(noted)
}

/// What a head's framing reads, noted header by header while the head is
/// parsed: framing the usual head (at most a `Connection`, no
/// `Transfer-Encoding`, one `Content-Length`) then looks up nothing but
/// the length.
#[derive(Clone, Copy, Default)]
pub struct Noted {
    /// `Host` lines.
    pub hosts: usize,
    /// A `Host` whose value is not a host (see [`valid_host`]).
    pub bad_host: bool,
    /// `Content-Length` lines.
    pub content_lengths: usize,
    /// The first `Content-Length` line's value, when it is a plain number.
    first_length: Option<u64>,
    pub transfer_encoding: bool,
    pub expect: bool,
    /// A `close` token in `Connection`.
    pub close: bool,
    /// A `keep-alive` token in `Connection`.
    pub keep_alive: bool,
    /// Another token in `Connection`: a header to drop at this hop.
    pub connection_names: bool,
    /// `Cookie` lines.
    pub cookies: usize,
}

impl Noted {
    /// The notes on a whole map, as if its headers had been parsed.
    #[cfg(test)]
    pub fn of(headers: &HeaderMap) -> Noted {
        let mut noted = Noted::default();
        for (name, value) in headers {
            noted.note(name, value);
        }
        noted
    }

    pub fn note(&mut self, name: &HeaderName, value: &HeaderValue) {
        if name == header::CONNECTION {
            for token in byte_tokens(value.as_bytes()) {
                let close = token.eq_ignore_ascii_case(b"close");
                let keep_alive = token.eq_ignore_ascii_case(b"keep-alive");
                self.close |= close;
                self.keep_alive |= keep_alive;
                self.connection_names |= !(close || keep_alive);
            }
        } else if name == header::CONTENT_LENGTH {
            self.content_lengths += 1;
            if self.content_lengths == 1 {
                self.first_length = plain_number(value.as_bytes());
            }
        } else if name == header::HOST {
            self.hosts += 1;
            self.bad_host |= !valid_host(value.as_bytes());
        } else if name == header::TRANSFER_ENCODING {
            self.transfer_encoding = true;
        } else if name == header::EXPECT {
            self.expect = true;
        } else if name == header::COOKIE {
            self.cookies += 1;
        }
    }

    /// Whether the `content-length` is absent or one line of a plain
    /// number, as it would be written afresh.
    pub fn plain_length(&self) -> bool {
        self.content_lengths == 0 || (self.content_lengths == 1 && self.first_length.is_some())
    }

    /// The `content-length`, as [`content_length`], with no lookup when
    /// there is none or one plain number.
    pub fn content_length(&self, headers: &HeaderMap) -> Result<Option<u64>, &'static str> {
        match (self.content_lengths, self.first_length) {
            (0, _) => Ok(None),
            (1, Some(length)) => Ok(Some(length)),
            _ => content_length(headers),
        }
    }
}

/// Why a request's `Host` lines refuse it (RFC 9112 §3.2, as nginx): more
/// than one, or one that is not a host ([`valid_host`]); it picks the
/// route and travels on as X-Forwarded-Host.
pub fn host_refusal(lines: usize, bad: bool) -> Option<&'static str> {
    if lines > 1 {
        Some("a request has one host header, not more")
    } else if bad {
        Some("the host header is not a host")
    } else {
        None
    }
}

/// Whether a `Host` value is one (RFC 9112 §3.2): `uri-host [":" port]`,
/// or empty when the target has no authority. The host is a name or IPv4
/// address (RFC 3986's unreserved, pct-encoded and sub-delims characters)
/// or a bracketed IP literal, the port digits. User info (`@`), paths,
/// queries, spaces and controls are refused, as nginx refuses them.
pub fn valid_host(value: &[u8]) -> bool {
    if let Some(literal) = value.strip_prefix(b"[") {
        let Some(end) = literal.iter().position(|&b| b == b']') else {
            return false;
        };
        let address = &literal[..end];
        return !address.is_empty()
            && address.iter().all(|&b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
            && is_port(&literal[end + 1..]);
    }
    // A table lookup a byte (the colon allowed), then the port's digits.
    value.iter().all(|&b| HOST_NAME[usize::from(b)])
        && value
            .iter()
            .position(|&b| b == b':')
            .is_none_or(|colon| is_port(&value[colon..]))
}

/// Nothing, or a colon and digits.
fn is_port(port: &[u8]) -> bool {
    port.is_empty() || (port[0] == b':' && port[1..].iter().all(u8::is_ascii_digit))
}

/// The bytes of a reg-name or IPv4 address (unreserved, sub-delims and
/// `%`), and the colon before a port.
static HOST_NAME: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = matches!(b as u8, b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'%'
            | b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b';' | b'=' | b':');
        b += 1;
    }
    table
};

/// The `content-length` (RFC 9112 §6.3): repeats of one value are one
/// value; differing, empty or malformed values (not ASCII digits) are
/// errors, never read as no length.
pub fn content_length(headers: &HeaderMap) -> Result<Option<u64>, &'static str> {
    let not_a_number = "content-length is not a number";
    let mut values = headers.get_all(http::header::CONTENT_LENGTH).into_iter();
    // The usual case, one plain number, without splitting and trimming.
    if let (Some(value), None) = (values.next(), values.next())
        && let Some(length) = plain_number(value.as_bytes())
    {
        return Ok(Some(length));
    }
    let mut length = None;
    for value in headers.get_all(http::header::CONTENT_LENGTH) {
        for value in value.to_str().map_err(|_| not_a_number)?.split(',') {
            let value = digits(value.trim()).ok_or(not_a_number)?;
            if length.is_some_and(|l| l != value) {
                return Err("conflicting content-length values");
            }
            length = Some(value);
        }
    }
    Ok(length)
}

/// Up to 19 ASCII digits and nothing else, as a number (it cannot
/// overflow).
fn plain_number(text: &[u8]) -> Option<u64> {
    if text.is_empty() || text.len() > 19 || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(text.iter().fold(0, |n, d| n * 10 + u64::from(d - b'0')))
}

/// A number of only decimal digits (no sign, unlike `str::parse`).
fn digits(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn line_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// Whether `partial`, the start of a line whose CRLF has not come, holds a
/// CR or LF that cannot be part of it (any but a CR at the very end): such
/// a line is malformed whatever follows, so it is refused at once rather
/// than waited on until the read times out.
fn bare_cr_or_lf(partial: &[u8]) -> bool {
    let before_last_cr = partial.strip_suffix(b"\r").unwrap_or(partial);
    before_last_cr.iter().any(|&b| b == b'\r' || b == b'\n')
}

/// `n` in decimal, written into `buf` without the formatting machinery.
pub fn itoa(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// `n` in hex (a chunk-size line), written into `buf`.
pub fn hex_len(mut n: usize, buf: &mut [u8; 16]) -> &[u8] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = HEX[n % 16];
        n /= 16;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// The header names this thread has seen lately, so a name that is not
/// one of the standard ones (`idempotency-key`, on every request) is not
/// allocated and lower-cased anew for each request.
pub mod names {
    use std::cell::RefCell;

    use http::header::{HeaderName, InvalidHeaderName};

    const SLOTS: usize = 64;
    /// The longest name kept.
    const MAX_KEPT: usize = 64;

    /// A name as a peer spelled it, and the name.
    struct Seen {
        spelling: [u8; MAX_KEPT],
        len: usize,
        name: HeaderName,
    }

    thread_local! {
        static SEEN: RefCell<[Option<Seen>; SLOTS]> = const { RefCell::new([const { None }; SLOTS]) };
    }

    /// `HeaderName::from_bytes`, from a direct-mapped cache when it holds
    /// the name. A peer spells a name the same way each time, so the cache
    /// keeps the last spelling too: the usual hit is one comparison of
    /// bytes. Another spelling of the same name (names ignore ASCII case) is
    /// a hit as well, and becomes the kept spelling.
    pub fn intern(bytes: &[u8]) -> Result<HeaderName, InvalidHeaderName> {
        // Long names are not kept: a client cycling them would pin their
        // buffers in the slots.
        let (Some(&first), Some(&last)) = (bytes.first(), bytes.last()) else {
            return HeaderName::from_bytes(bytes);
        };
        if bytes.len() > MAX_KEPT {
            return HeaderName::from_bytes(bytes);
        }
        let slot = (bytes.len() * 31 + usize::from(first | 0x20) * 7 + usize::from(last | 0x20)) % SLOTS;
        SEEN.with_borrow_mut(|seen| {
            if let Some(kept) = &mut seen[slot] {
                if &kept.spelling[..kept.len] == bytes {
                    return Ok(kept.name.clone());
                }
                if kept.name.as_str().as_bytes().eq_ignore_ascii_case(bytes) {
                    kept.spelling[..bytes.len()].copy_from_slice(bytes);
                    kept.len = bytes.len();
                    return Ok(kept.name.clone());
                }
            }
            let name = HeaderName::from_bytes(bytes)?;
            let mut spelling = [0; MAX_KEPT];
            spelling[..bytes.len()].copy_from_slice(bytes);
            seen[slot] = Some(Seen {
                spelling,
                len: bytes.len(),
                name: name.clone(),
            });
            Ok(name)
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn interned_names_are_the_names() {
            for raw in ["Idempotency-Key", "idempotency-key", "Host", "x-a", "x-b", "X-A"] {
                let name = intern(raw.as_bytes()).unwrap();
                assert_eq!(name, HeaderName::from_bytes(raw.as_bytes()).unwrap());
                assert_eq!(name.as_str(), raw.to_ascii_lowercase());
            }
            assert!(intern(b"bad name").is_err());
            assert!(intern(b"").is_err());
            // A cached name never vouches for a different one of its slot
            // ("x-a" and "x a" share one).
            intern(b"x-a").unwrap();
            assert!(intern(b"x a").is_err());
            assert_eq!(intern(b"X-A").unwrap(), "x-a");
            assert_eq!(intern(b"X-A").unwrap(), "x-a");
            assert_eq!(intern(b"x-a").unwrap(), "x-a");
            let long = "x".repeat(MAX_KEPT + 1);
            assert_eq!(intern(long.as_bytes()).unwrap().as_str(), long);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_names_pass_the_length_filter() {
        for name in &HOP_BY_HOP {
            assert!(is_hop_by_hop(name), "{name}");
        }
        for name in [
            "date",
            "server",
            "content-type",
            "content-length",
            "x-te",
            "connectionx",
        ] {
            assert!(!is_hop_by_hop(&HeaderName::from_static(name)), "{name}");
        }
    }

    #[test]
    fn numbers_render() {
        assert_eq!(itoa(0, &mut [0; 20]), b"0");
        assert_eq!(itoa(u64::MAX, &mut [0; 20]), u64::MAX.to_string().as_bytes());
        assert_eq!(hex_len(0, &mut [0; 16]), b"0");
        assert_eq!(hex_len(0x1f2e, &mut [0; 16]), b"1f2e");
    }

    fn chunks(wire: &[u8]) -> (Vec<u8>, Option<HeaderMap>, bool) {
        let mut state = Chunked::Size;
        let mut buf = BytesMut::from(wire);
        let (mut data, mut trailers) = (Vec::new(), None);
        while let Some(frame) = next_chunk(&mut state, &mut buf).unwrap() {
            match frame.into_data() {
                Ok(bytes) => data.extend_from_slice(&bytes),
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        (data, trailers, matches!(state, Chunked::Done))
    }

    #[test]
    fn chunked_bodies_decode_with_extensions_and_trailers() {
        let (data, trailers, done) = chunks(b"5;ext=1\r\nhello\r\n1\r\n!\r\n0\r\nx-sum: 6 \r\n\r\n");
        assert_eq!(data, b"hello!");
        assert!(done);
        assert_eq!(trailers.unwrap()["x-sum"], "6");

        // Cut anywhere, it waits for more rather than failing.
        let (data, _, done) = chunks(b"5\r\nhel");
        assert_eq!(data, b"hel");
        assert!(!done);

        // Blanks around a value are spaces and tabs; a bare CR or LF is
        // refused, not trimmed into a line another parser would split.
        let (_, trailers, _) = chunks(b"0\r\nx-sum:\t 6\t\r\n\r\n");
        assert_eq!(trailers.unwrap()["x-sum"], "6");
        for wire in [&b"0\r\nx:\nfoo: b\r\n\r\n"[..], b"0\r\nx: a\r\r\n\r\n"] {
            let mut state = Chunked::Size;
            assert!(next_chunk(&mut state, &mut BytesMut::from(wire)).is_err());
        }
    }

    #[test]
    fn a_chunk_size_line_is_bounded_whole_or_not() {
        let line = |ext: usize| format!("1;{}\r\nx\r\n0\r\n\r\n", "a".repeat(ext));
        let (data, _, done) = chunks(line(MAX_SIZE_LINE - 2).as_bytes());
        assert_eq!((data.as_slice(), done), (&b"x"[..], true));
        // Whole, with its CRLF in the buffer, and one byte too long.
        let mut state = Chunked::Size;
        let mut buf = BytesMut::from(line(MAX_SIZE_LINE - 1).as_bytes());
        assert!(next_chunk(&mut state, &mut buf).is_err());
        // The longest line, read up to its CR: wait for the LF.
        let mut state = Chunked::Size;
        let mut buf = BytesMut::from(&line(MAX_SIZE_LINE - 2).as_bytes()[..MAX_SIZE_LINE + 1]);
        assert!(matches!(next_chunk(&mut state, &mut buf), Ok(None)));
        // Not yet whole, and already too long.
        let mut state = Chunked::Size;
        let mut buf = BytesMut::from(&line(2 * MAX_SIZE_LINE).as_bytes()[..MAX_SIZE_LINE + 2]);
        assert!(next_chunk(&mut state, &mut buf).is_err());
    }

    #[test]
    fn chunks_and_trailers_sent_a_byte_at_a_time_decode_alike() {
        let wire = b"5;e=1\r\nhello\r\n0\r\nx-sum: 6\r\nx-long: aaaaaaaaaaaaaaaa\r\n\r\n";
        let mut state = Chunked::Size;
        let mut buf = BytesMut::new();
        let (mut data, mut trailers) = (Vec::new(), None);
        for &byte in wire {
            buf.extend_from_slice(&[byte]);
            while let Some(frame) = next_chunk(&mut state, &mut buf).unwrap() {
                match frame.into_data() {
                    Ok(bytes) => data.extend_from_slice(&bytes),
                    Err(frame) => trailers = frame.into_trailers().ok(),
                }
            }
        }
        assert!(matches!(state, Chunked::Done) && buf.is_empty());
        assert_eq!(data, b"hello");
        let trailers = trailers.unwrap();
        assert_eq!(
            (trailers["x-sum"].as_bytes(), trailers["x-long"].as_bytes()),
            (&b"6"[..], &b"aaaaaaaaaaaaaaaa"[..])
        );
        // A bare LF in a trailer line sent a byte at a time is still seen.
        let mut state = Chunked::Size;
        let mut buf = BytesMut::new();
        let refused = b"0\r\nx: a\nb".iter().any(|&byte| {
            buf.extend_from_slice(&[byte]);
            next_chunk(&mut state, &mut buf).is_err()
        });
        assert!(refused);
    }

    /// What a chunked body fed in pieces comes to: its data and trailers
    /// when it ends, or that it was refused, or that it has not ended.
    #[derive(Debug, PartialEq)]
    enum Decoded {
        Whole(Vec<u8>, Vec<(String, Vec<u8>)>, usize),
        Refused,
        Unfinished,
    }

    fn decode_in_pieces(wire: &[u8], cuts: &[usize]) -> Decoded {
        let mut state = Chunked::Size;
        let mut buf = BytesMut::new();
        let (mut data, mut trailers) = (Vec::new(), Vec::new());
        let mut at = 0;
        for end in cuts.iter().copied().chain([wire.len()]) {
            buf.extend_from_slice(&wire[at..end]);
            at = end;
            loop {
                match next_chunk(&mut state, &mut buf) {
                    Err(_) => return Decoded::Refused,
                    Ok(None) if matches!(state, Chunked::Done) => {
                        return Decoded::Whole(data, trailers, buf.len());
                    }
                    Ok(None) => break,
                    Ok(Some(frame)) => match frame.into_data() {
                        Ok(bytes) => data.extend_from_slice(&bytes),
                        Err(frame) => {
                            let map = frame.into_trailers().ok().unwrap_or_default();
                            trailers = map
                                .iter()
                                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                                .collect();
                        }
                    },
                }
            }
        }
        Decoded::Unfinished
    }

    /// Random chunked bodies, some with one byte changed, decode the same
    /// whole and cut into random pieces: what the parser accepts or refuses
    /// never depends on how the bytes arrive.
    #[test]
    fn chunked_bodies_decode_alike_however_they_arrive() {
        let mut next = crate::testing::numbers(0x9E37_79B9_7F4A_7C15);
        let alphabet = b"0123456789abcdefxX;= \t\r\n:-";
        let (mut refused, mut whole) = (0, 0);
        for _ in 0..3000 {
            let mut wire = Vec::new();
            for _ in 0..next(4) {
                let size = 1 + next(20);
                wire.extend_from_slice(format!("{size:x}").as_bytes());
                if next(3) == 0 {
                    wire.extend_from_slice(b";ext=1");
                }
                wire.extend_from_slice(b"\r\n");
                wire.extend((0..size).map(|i| b'a' + (i % 26) as u8));
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(b"0\r\n");
            for t in 0..next(3) {
                wire.extend_from_slice(format!("x-t{t}: v{t}\r\n").as_bytes());
            }
            wire.extend_from_slice(b"\r\n");
            if next(2) == 0 {
                let at = next(wire.len());
                wire[at] = alphabet[next(alphabet.len())];
            }
            let expected = decode_in_pieces(&wire, &[]);
            for _ in 0..4 {
                let mut cuts: Vec<usize> = (0..next(wire.len().min(12))).map(|_| next(wire.len())).collect();
                cuts.sort_unstable();
                assert_eq!(
                    decode_in_pieces(&wire, &cuts),
                    expected,
                    "{:?} cut at {cuts:?}",
                    String::from_utf8_lossy(&wire)
                );
            }
            let bytewise: Vec<usize> = (1..wire.len()).collect();
            assert_eq!(
                decode_in_pieces(&wire, &bytewise),
                expected,
                "{:?} a byte at a time",
                String::from_utf8_lossy(&wire)
            );
            match expected {
                Decoded::Refused => refused += 1,
                Decoded::Whole(..) => whole += 1,
                Decoded::Unfinished => {}
            }
        }
        // Both kinds were exercised.
        assert!(refused > 300 && whole > 1500, "{refused} refused, {whole} whole");
    }

    #[test]
    fn trailers_are_bounded() {
        let mut wire = b"0\r\n".to_vec();
        for i in 0..MAX_HEADERS + 1 {
            wire.extend_from_slice(format!("x-t{i}: 1\r\n").as_bytes());
        }
        let mut state = Chunked::Size;
        let mut buf = BytesMut::from(&wire[..]);
        assert!(next_chunk(&mut state, &mut buf).is_err());

        // Exactly as many as a head may have: taken.
        let mut wire = b"0\r\n".to_vec();
        for i in 0..MAX_HEADERS {
            wire.extend_from_slice(format!("x-t{i}: 1\r\n").as_bytes());
        }
        wire.extend_from_slice(b"\r\n");
        let (_, trailers, done) = chunks(&wire);
        assert!(done);
        assert_eq!(trailers.unwrap().len(), MAX_HEADERS);
    }

    #[test]
    fn content_lengths_are_one_number_or_an_error() {
        let length = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for v in values {
                headers.append(http::header::CONTENT_LENGTH, HeaderValue::from_str(v).unwrap());
            }
            // Noted as the headers were parsed, the same answer.
            let read = content_length(&headers);
            assert_eq!(Noted::of(&headers).content_length(&headers), read, "{values:?}");
            read
        };
        assert_eq!(length(&[]), Ok(None));
        assert_eq!(length(&["42"]), Ok(Some(42)));
        assert_eq!(length(&["18446744073709551615"]), Ok(Some(u64::MAX)));
        assert_eq!(length(&["7, 7", "7"]), Ok(Some(7)));
        for bad in [
            &[""][..],
            &["1x"],
            &["-1"],
            &["18446744073709551616"],
            &["1", "2"],
            &["1,"],
        ] {
            assert!(length(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn chunk_size_lines_are_read_strictly() {
        assert_eq!(chunk_size(b"1f"), Some(31));
        assert_eq!(chunk_size(b"1f ;ext=\"a b\""), Some(31));
        assert_eq!(chunk_size(b"0"), Some(0));
        assert_eq!(chunk_size(b"000"), Some(0));
        assert_eq!(chunk_size(b"00000000000000001f"), Some(31));
        assert_eq!(chunk_size(b"ffffffffffffffff"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b" 1",
            b"1\n",
            b"2;\nxx",
            b"1\r",
            b"+1",
            b"1 x",
            b"11111111111111111",
            b"\xc2\xa01",
        ] {
            assert_eq!(chunk_size(bad), None, "{bad:?}");
        }
        // A bare LF inside what ends at CRLF is refused, not read around.
        let mut state = Chunked::Size;
        let mut buf = BytesMut::from(&b"2;\nxx\r\nab\r\n0\r\n\r\n"[..]);
        assert!(next_chunk(&mut state, &mut buf).is_err());
    }

    #[test]
    fn a_bare_cr_or_lf_is_refused_before_the_line_ends() {
        // Each malformed before its CRLF comes (which may be never): refused
        // at once, not waited on.
        for wire in [
            &b"5\n"[..],
            b"5\nhel",
            b"5\rx",
            b"5\r\nhello\n",
            b"5\r\nhello\r\n0\n",
            b"0\r\nx: a\n",
            b"0\r\nx: a\rb",
        ] {
            let mut state = Chunked::Size;
            let mut buf = BytesMut::from(wire);
            let read = std::iter::from_fn(|| Some(next_chunk(&mut state, &mut buf)))
                .take_while(|r| !matches!(r, Ok(None)))
                .find(Result::is_err);
            assert!(read.is_some(), "{wire:?}");
        }
        // A CR at the end may be the CRLF's: wait for its LF.
        for wire in [&b"5\r"[..], b"5\r\nhello\r", b"0\r\nx: a\r"] {
            let mut state = Chunked::Size;
            let mut buf = BytesMut::from(wire);
            while let Some(frame) = next_chunk(&mut state, &mut buf).unwrap() {
                drop(frame);
            }
        }
    }

    #[test]
    fn malformed_chunks_are_errors() {
        let mut state = Chunked::Size;
        let mut buf = BytesMut::from(&b"zz\r\n"[..]);
        assert!(next_chunk(&mut state, &mut buf).is_err());
        let mut state = Chunked::Size;
        let mut buf = BytesMut::from(&b"1\r\nabc"[..]);
        assert!(next_chunk(&mut state, &mut buf).unwrap().is_some());
        assert!(next_chunk(&mut state, &mut buf).is_err());
    }
}
