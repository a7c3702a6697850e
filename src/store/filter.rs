//! Which record keys a file holds, kept in memory, so a claim of a new key
//! (the common case) does not read the file to learn that it is absent.
//!
//! Keys are SHA-256 digests: their first eight bytes are spread evenly and
//! serve as the filter's key. Two keys of the file may share them, so each
//! is counted; a shared prefix only costs a read of the file, never a
//! wrong answer. The filter may say "maybe" of a key the file does not hold
//! (a read that finds nothing), never "no" of one it does.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{KeyMap, lock};

const SHARDS: usize = 16;

pub(crate) struct KeyFilter {
    shards: [Mutex<KeyMap<u64, u32>>; SHARDS],
    /// Until the file's keys are loaded, every key may be in it.
    ready: AtomicBool,
}

impl Default for KeyFilter {
    fn default() -> KeyFilter {
        KeyFilter {
            shards: std::array::from_fn(|_| Mutex::new(KeyMap::default())),
            ready: AtomicBool::new(false),
        }
    }
}

impl KeyFilter {
    fn prefix(key: &[u8; 32]) -> u64 {
        u64::from_le_bytes(key[..8].try_into().expect("8 bytes"))
    }

    fn shard(&self, prefix: u64) -> &Mutex<KeyMap<u64, u32>> {
        &self.shards[(prefix >> 60) as usize % SHARDS]
    }

    /// Whether the file may hold `key`.
    pub(crate) fn may_hold(&self, key: &[u8; 32]) -> bool {
        if !self.ready.load(Ordering::Acquire) {
            return true;
        }
        let prefix = KeyFilter::prefix(key);
        lock(self.shard(prefix)).contains_key(&prefix)
    }

    /// `key` is (about to be) in the file: call before the transaction that
    /// adds it commits.
    pub(crate) fn add(&self, key: &[u8; 32]) {
        let prefix = KeyFilter::prefix(key);
        *lock(self.shard(prefix)).entry(prefix).or_insert(0) += 1;
    }

    /// `key` has left the file: call once the transaction that removed it
    /// has committed.
    pub(crate) fn remove(&self, key: &[u8; 32]) {
        let prefix = KeyFilter::prefix(key);
        let mut shard = lock(self.shard(prefix));
        if let Some(count) = shard.get_mut(&prefix) {
            *count -= 1;
            if *count == 0 {
                shard.remove(&prefix);
            }
        }
    }

    /// Every key of the file has been added: from now on the filter answers.
    pub(crate) fn loaded(&self) {
        self.ready.store(true, Ordering::Release);
    }

    /// How many distinct prefixes it holds.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|shard| lock(shard).len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(prefix: u64, rest: u8) -> [u8; 32] {
        let mut key = [rest; 32];
        key[..8].copy_from_slice(&prefix.to_le_bytes());
        key
    }

    #[test]
    fn says_maybe_until_loaded_then_only_of_keys_added() {
        let filter = KeyFilter::default();
        assert!(filter.may_hold(&key(1, 0)), "not loaded: anything may be there");
        filter.add(&key(1, 0));
        filter.loaded();
        assert!(filter.may_hold(&key(1, 0)));
        assert!(!filter.may_hold(&key(2, 0)));
        filter.remove(&key(1, 0));
        assert!(!filter.may_hold(&key(1, 0)));
        assert_eq!(filter.len(), 0);
    }

    #[test]
    fn keys_sharing_a_prefix_are_counted() {
        let filter = KeyFilter::default();
        filter.loaded();
        filter.add(&key(7, 1));
        filter.add(&key(7, 2));
        filter.remove(&key(7, 1));
        assert!(filter.may_hold(&key(7, 2)), "the other key is still in the file");
        filter.remove(&key(7, 2));
        assert!(!filter.may_hold(&key(7, 2)));
    }
}
