//! The in-process key-value table: [`InMemoryStore`] for threads-as-ranks and tests, and the
//! table behind the TCP [`StoreServer`](super::StoreServer).
//!
//! It owns the semantics of every store operation (what `add` stores, what `compare_set`
//! returns, how waits end). It knows nothing about sockets, frames or authentication.
//!
//! Waiting operations sleep on one condition variable that every write notifies; they never
//! spin. A table can be *closed* (the server does this on shutdown), which wakes every waiter
//! with [`ErrorKind::PeerGone`].

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Store, MAX_KEY_LEN, MAX_VALUE_LEN};
use crate::error::{Error, ErrorKind, Result};

/// Size limits enforced on every write (keys and values).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_key_len: usize,
    pub(crate) max_value_len: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { max_key_len: MAX_KEY_LEN, max_value_len: MAX_VALUE_LEN }
    }
}

impl Limits {
    pub(crate) fn check_key(&self, key: &str) -> Result<()> {
        if key.len() > self.max_key_len {
            return Err(Error::invalid(format!(
                "store key of {} bytes exceeds the limit of {} bytes",
                key.len(),
                self.max_key_len
            )));
        }
        Ok(())
    }

    pub(crate) fn check_value(&self, key: &str, value: &[u8]) -> Result<()> {
        if value.len() > self.max_value_len {
            return Err(Error::invalid(format!(
                "value of {} bytes for store key {key:?} exceeds the limit of {} bytes",
                value.len(),
                self.max_value_len
            )));
        }
        Ok(())
    }
}

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    closed: bool,
}

/// The shared table: a map under a mutex plus a condition variable for waiters.
pub(crate) struct Table {
    state: Mutex<State>,
    changed: Condvar,
    limits: Limits,
}

impl Table {
    pub(crate) fn new(limits: Limits) -> Table {
        Table { state: Mutex::new(State::default()), changed: Condvar::new(), limits }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock, so a poisoned lock still holds a valid map.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every waiter with an error; later waits fail at once. Writes still work, so a
    /// connection that is mid-request finishes it.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    pub(crate) fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.limits.check_key(key)?;
        self.limits.check_value(key, value)?;
        self.lock().map.insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    pub(crate) fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.limits.check_key(key)?;
        Ok(self.lock().map.get(key).cloned())
    }

    pub(crate) fn get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.limits.check_key(key)?;
        let start = Instant::now();
        let mut state = self.lock();
        loop {
            if let Some(value) = state.map.get(key) {
                return Ok(value.clone());
            }
            state = self.sleep(state, start, deadline, || format!("store key {key:?}"))?;
        }
    }

    pub(crate) fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        for key in keys {
            self.limits.check_key(key)?;
        }
        let start = Instant::now();
        let mut state = self.lock();
        loop {
            let missing: Vec<&str> = keys.iter().copied().filter(|k| !state.map.contains_key(*k)).collect();
            if missing.is_empty() {
                return Ok(());
            }
            state = self.sleep(state, start, deadline, || describe_missing(&missing))?;
        }
    }

    /// One sleep of a waiting op: fails when the table is closed or `deadline` has passed.
    fn sleep<'a>(
        &self,
        state: MutexGuard<'a, State>,
        start: Instant,
        deadline: Instant,
        what: impl FnOnce() -> String,
    ) -> Result<MutexGuard<'a, State>> {
        if state.closed {
            return Err(Error::new(ErrorKind::PeerGone, format!("store shut down while waiting for {}", what())));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("timed out after {} waiting for {}", fmt_duration(now - start), what()),
            ));
        }
        let (state, _) = self.changed.wait_timeout(state, deadline - now).unwrap_or_else(|e| e.into_inner());
        Ok(state)
    }

    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.limits.check_key(key)?;
        let mut state = self.lock();
        let current = match state.map.get(key) {
            None => 0,
            Some(bytes) => parse_counter(key, bytes)?,
        };
        let next = current
            .checked_add(delta)
            .ok_or_else(|| Error::invalid(format!("store counter {key:?} overflows: {current} + {delta}")))?;
        state.map.insert(key.to_owned(), next.to_string().into_bytes());
        drop(state);
        self.changed.notify_all();
        Ok(next)
    }

    pub(crate) fn delete(&self, key: &str) -> Result<bool> {
        self.limits.check_key(key)?;
        Ok(self.lock().map.remove(key).is_some())
    }

    pub(crate) fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<Vec<u8>> {
        self.limits.check_key(key)?;
        self.limits.check_value(key, new)?;
        if let Some(expected) = expected {
            self.limits.check_value(key, expected)?;
        }
        let mut state = self.lock();
        let current = state.map.get(key);
        let matches = match (current, expected) {
            (None, None) => true,
            (Some(cur), Some(exp)) => cur.as_slice() == exp,
            _ => false,
        };
        if !matches {
            return Ok(current.cloned().unwrap_or_default());
        }
        state.map.insert(key.to_owned(), new.to_vec());
        drop(state);
        self.changed.notify_all();
        Ok(new.to_vec())
    }
}

fn parse_counter(key: &str, bytes: &[u8]) -> Result<i64> {
    std::str::from_utf8(bytes).ok().and_then(|s| s.parse::<i64>().ok()).ok_or_else(|| {
        Error::invalid(format!(
            "store key {key:?} holds {} bytes that are not a decimal counter; add() needs one",
            bytes.len()
        ))
    })
}

fn describe_missing(missing: &[&str]) -> String {
    const SHOWN: usize = 4;
    let mut s = String::from("store keys ");
    for (i, key) in missing.iter().take(SHOWN).enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&format!("{key:?}"));
    }
    if missing.len() > SHOWN {
        s.push_str(&format!(" and {} more", missing.len() - SHOWN));
    }
    s
}

pub(crate) fn fmt_duration(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{:.1}s", d.as_secs_f64())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// A store that lives in this process: ranks that are threads share one (clones share the same
/// table). Same operations and limits as the TCP store.
///
/// ```
/// use std::time::{Duration, Instant};
/// use oxcomm::rendezvous::{InMemoryStore, Store};
///
/// let store = InMemoryStore::new();
/// let other = store.clone(); // same table
/// other.set("addr/1", b"127.0.0.1:4000")?;
/// let deadline = Instant::now() + Duration::from_secs(1);
/// assert_eq!(store.get("addr/1", deadline)?, b"127.0.0.1:4000");
/// assert_eq!(store.add("arrived", 1)?, 1);
/// # Ok::<(), oxcomm::Error>(())
/// ```
#[derive(Clone)]
pub struct InMemoryStore {
    table: Arc<Table>,
}

impl InMemoryStore {
    /// An empty store with the default limits ([`MAX_KEY_LEN`], [`MAX_VALUE_LEN`]).
    pub fn new() -> InMemoryStore {
        InMemoryStore { table: Arc::new(Table::new(Limits::default())) }
    }
}

impl Default for InMemoryStore {
    fn default() -> InMemoryStore {
        InMemoryStore::new()
    }
}

impl std::fmt::Debug for InMemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = self.table.lock().map.len();
        f.debug_struct("InMemoryStore").field("keys", &keys).finish()
    }
}

impl Store for InMemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.table.set(key, value)
    }

    fn get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.table.get(key, deadline)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.table.try_get(key)
    }

    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        self.table.wait(keys, deadline)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.table.add(key, delta)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.table.delete(key)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<Vec<u8>> {
        self.table.compare_set(key, expected, new)
    }
}
