//! Requests waiting for a key to leave flight, in this process: one
//! `Notify` per waited-on key, dropped with its last waiter.

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::{KeyMap, RecordKey, lock};

#[derive(Default)]
pub struct Waiters {
    keys: Mutex<KeyMap<RecordKey, (Arc<Notify>, usize)>>,
}

/// One registered waiter; deregisters on drop.
pub struct Registration<'a> {
    waiters: &'a Waiters,
    key: RecordKey,
    pub notify: Arc<Notify>,
}

impl Waiters {
    /// Registers interest in `key`. Create and enable a `notified()` future
    /// from the registration *before* re-checking the record, so a wake
    /// between the check and the wait is not lost.
    pub fn register(&self, key: RecordKey) -> Registration<'_> {
        let mut keys = lock(&self.keys);
        let entry = keys.entry(key).or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        Registration {
            waiters: self,
            key,
            notify: entry.0.clone(),
        }
    }

    /// Wakes every waiter of `key`.
    pub fn wake(&self, key: &RecordKey) {
        let keys = lock(&self.keys);
        if let Some((notify, _)) = keys.get(key) {
            notify.notify_waiters();
        }
    }

    /// Wakes everyone: used when notifications may have been missed.
    pub fn wake_all(&self) {
        let keys = lock(&self.keys);
        for (notify, _) in keys.values() {
            notify.notify_waiters();
        }
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let mut keys = lock(&self.waiters.keys);
        if let Some(entry) = keys.get_mut(&self.key) {
            entry.1 -= 1;
            if entry.1 == 0 {
                keys.remove(&self.key);
            }
        }
    }
}
