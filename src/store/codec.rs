//! The byte layout of a record, shared by the embedded and Redis stores.
//!
//! ```text
//! offset  size  field
//! 0       1     version (1)
//! 1       1     kind: 0 in flight, 1 response, 2 not replayable, 3 unknown
//! 2       32    fingerprint
//! in flight:
//! 34      16    owner token
//! response:
//! 34      2     status
//! 36      2     header count, then per header:
//!               2 name length, name, 4 value length, value
//! ...           body (the rest)
//! ```
//!
//! The fixed prefix lets the Redis Lua scripts check the kind, the
//! fingerprint and the owner with `string.byte` and `string.sub`. A later
//! idemgate reads version 1 records by this byte; a record of an unknown
//! version is reported as corrupt rather than misread.

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;

use super::{Fingerprint, Outcome, Owner, StoreError, StoredResponse};

pub const VERSION: u8 = 1;
pub const IN_FLIGHT: u8 = 0;
const RESPONSE: u8 = 1;
const NOT_REPLAYABLE: u8 = 2;
const UNKNOWN: u8 = 3;
/// Bytes before the kind-specific part.
pub const PREFIX: usize = 34;

/// A decoded record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    InFlight { fingerprint: Fingerprint, owner: Owner },
    Completed { fingerprint: Fingerprint, outcome: Outcome },
}

fn prefix(kind: u8, fingerprint: &Fingerprint, capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX + capacity);
    out.push(VERSION);
    out.push(kind);
    out.extend_from_slice(&fingerprint.0);
    out
}

pub fn in_flight(fingerprint: &Fingerprint, owner: Owner) -> Vec<u8> {
    let mut out = prefix(IN_FLIGHT, fingerprint, 16);
    out.extend_from_slice(&owner.0.to_be_bytes());
    out
}

pub fn owner_bytes(owner: Owner) -> [u8; 16] {
    owner.0.to_be_bytes()
}

pub fn completed(fingerprint: &Fingerprint, outcome: &Outcome) -> Vec<u8> {
    match outcome {
        Outcome::NotReplayable => prefix(NOT_REPLAYABLE, fingerprint, 0),
        Outcome::Unknown => prefix(UNKNOWN, fingerprint, 0),
        Outcome::Response(response) => {
            let mut out = prefix(RESPONSE, fingerprint, response.size());
            out.extend_from_slice(&response.status.as_u16().to_be_bytes());
            let count = u16::try_from(response.headers().len()).unwrap_or(u16::MAX);
            out.extend_from_slice(&count.to_be_bytes());
            for (name, value) in response.headers().take(count as usize) {
                out.extend_from_slice(&(name.len() as u16).to_be_bytes());
                out.extend_from_slice(name.as_bytes());
                out.extend_from_slice(&(value.len() as u32).to_be_bytes());
                out.extend_from_slice(value);
            }
            out.extend_from_slice(response.body_bytes());
            out
        }
    }
}

/// The fingerprint of an encoded record, without decoding the rest.
pub fn fingerprint_of(bytes: &[u8]) -> Result<Fingerprint, StoreError> {
    check(bytes)?;
    Ok(Fingerprint(bytes[2..PREFIX].try_into().expect("32 bytes")))
}

fn check(bytes: &[u8]) -> Result<(), StoreError> {
    if bytes.len() < PREFIX {
        return Err(StoreError::Corrupt("record too short"));
    }
    if bytes[0] != VERSION {
        return Err(StoreError::Corrupt("unknown record version"));
    }
    Ok(())
}

struct Reader {
    bytes: Bytes,
    at: usize,
}

impl Reader {
    /// Steps over `n` bytes; returns where they are.
    fn skip(&mut self, n: usize) -> Result<std::ops::Range<usize>, StoreError> {
        if self.bytes.len() - self.at < n {
            return Err(StoreError::Corrupt("record truncated"));
        }
        self.at += n;
        Ok(self.at - n..self.at)
    }

    fn u16(&mut self) -> Result<u16, StoreError> {
        let at = self.skip(2)?;
        Ok(u16::from_be_bytes(self.bytes[at].try_into().expect("2 bytes")))
    }

    fn u32(&mut self) -> Result<u32, StoreError> {
        let at = self.skip(4)?;
        Ok(u32::from_be_bytes(self.bytes[at].try_into().expect("4 bytes")))
    }
}

/// Decodes a record; the body is a zero-copy slice of `bytes`.
pub fn decode(bytes: Bytes) -> Result<Decoded, StoreError> {
    let fingerprint = fingerprint_of(&bytes)?;
    let kind = bytes[1];
    let mut r = Reader { bytes, at: PREFIX };
    let outcome = match kind {
        IN_FLIGHT => {
            let at = r.skip(16)?;
            let owner = u128::from_be_bytes(r.bytes[at].try_into().expect("16 bytes"));
            return Ok(Decoded::InFlight {
                fingerprint,
                owner: Owner(owner),
            });
        }
        NOT_REPLAYABLE => Outcome::NotReplayable,
        UNKNOWN => Outcome::Unknown,
        RESPONSE => {
            let status = StatusCode::from_u16(r.u16()?).map_err(|_| StoreError::Corrupt("bad status"))?;
            let count = r.u16()?;
            let mut headers = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let len = r.u16()? as usize;
                let name = r.skip(len)?;
                let len = r.u32()? as usize;
                headers.push((name, r.skip(len)?));
            }
            let body = r.at..r.bytes.len();
            let response = StoredResponse::in_block(status, r.bytes, headers, body)
                .ok_or(StoreError::Corrupt("bad header name or value"))?;
            Outcome::Response(Arc::new(response))
        }
        _ => return Err(StoreError::Corrupt("unknown record kind")),
    };
    Ok(Decoded::Completed { fingerprint, outcome })
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, HeaderValue};

    use super::*;

    #[test]
    fn every_kind_round_trips() {
        let fp = Fingerprint([7; 32]);
        let (json, empty) = (
            HeaderValue::from_static("application/json"),
            HeaderValue::from_static(""),
        );
        let response = Outcome::Response(Arc::new(StoredResponse::new(
            StatusCode::CREATED,
            &[
                (&HeaderName::from_static("content-type"), &json),
                (&HeaderName::from_static("x-a"), &empty),
            ],
            &[Bytes::from_static(b"{\"id\":"), Bytes::from_static(b"1}")],
        )));
        for outcome in [response, Outcome::NotReplayable, Outcome::Unknown] {
            let bytes = completed(&fp, &outcome);
            assert_eq!(
                decode(Bytes::from(bytes)).unwrap(),
                Decoded::Completed {
                    fingerprint: fp,
                    outcome
                }
            );
        }
        let owner = Owner(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        let bytes = in_flight(&fp, owner);
        assert_eq!(&bytes[PREFIX..], &owner_bytes(owner));
        assert_eq!(
            decode(Bytes::from(bytes)).unwrap(),
            Decoded::InFlight { fingerprint: fp, owner }
        );
    }

    #[test]
    fn damaged_records_are_errors_not_panics() {
        let fp = Fingerprint([1; 32]);
        let good = completed(
            &fp,
            &Outcome::Response(Arc::new(StoredResponse::new(
                StatusCode::OK,
                &[(&HeaderName::from_static("a"), &HeaderValue::from_static("b"))],
                &[],
            ))),
        );
        for cut in 0..good.len() - 1 {
            let _ = decode(Bytes::copy_from_slice(&good[..cut]));
        }
        let mut future = good.clone();
        future[0] = 2;
        assert!(decode(Bytes::from(future)).is_err());
        // The name `a` (after status, count and its length), then its value `b`.
        let name = PREFIX + 2 + 2 + 2;
        assert_eq!(good[name], b'a');
        for (at, bad) in [(name, b' '), (name + 1 + 4, b'\n')] {
            let mut damaged = good.clone();
            damaged[at] = bad;
            assert!(matches!(decode(Bytes::from(damaged)), Err(StoreError::Corrupt(_))));
        }
        // A name in capitals still replays under its lowercase name.
        let mut shouting = good.clone();
        shouting[name] = b'A';
        let Decoded::Completed {
            outcome: Outcome::Response(response),
            ..
        } = decode(Bytes::from(shouting)).unwrap()
        else {
            panic!("not a response")
        };
        let (name, value) = response.header_values().next().unwrap();
        assert_eq!((name.as_str(), value.as_bytes()), ("a", &b"b"[..]));
    }
}
