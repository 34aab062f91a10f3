//! Rendezvous: how the ranks of a job find their place and each other, once, at setup.
//!
//! This module owns
//! * the [`Store`] trait, a small key-value interface with deadlines, and its implementations:
//!   [`InMemoryStore`] (ranks are threads of one process), the authenticated TCP store
//!   ([`StoreServer`] / [`StoreClient`]) and [`PrefixStore`] (namespacing);
//! * [`EnvInfo`]: discovery of this process's rank, world size and local rank from the
//!   launcher's environment (torchrun, Open MPI, PMI, Slurm, oxcomm's own launcher);
//! * [`Settings`]: the `OXCOMM_*` variables that configure setup (token, timeout, interface);
//! * [`generate_token`], the shared secret a launcher hands to its ranks.
//!
//! It knows nothing about collectives or transports: the communicator setup code publishes
//! whatever addresses it needs under keys of its choosing. The store is used at setup only,
//! never on the data path.
//!
//! # Keys, values and limits
//!
//! Keys are UTF-8 strings of at most [`MAX_KEY_LEN`] bytes, values are byte strings of at most
//! [`MAX_VALUE_LEN`] bytes; longer ones are rejected with [`ErrorKind::InvalidArgument`]
//! (`crate::ErrorKind`). Counters written by [`Store::add`] are stored as decimal ASCII
//! (`"3"`), so [`Store::get`] on a counter key reads its value.
//!
//! # Deadlines
//!
//! Every waiting operation takes a deadline and fails with [`ErrorKind::Timeout`] when it
//! passes; there is no wait-forever variant. Non-waiting operations of the TCP client are
//! bounded by its op timeout ([`StoreClient::with_op_timeout`]).
//!
//! [`ErrorKind::InvalidArgument`]: crate::ErrorKind::InvalidArgument
//! [`ErrorKind::Timeout`]: crate::ErrorKind::Timeout

use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, Result};

pub mod env;
mod memory;
pub mod store;
pub(crate) mod store_wire;

pub use env::{EnvInfo, EnvSource, Settings, TransportChoice};
pub use memory::InMemoryStore;
pub use store::{StoreClient, StoreServer, StoreServerBuilder};

/// Longest key a store accepts, in bytes (4 KiB).
pub const MAX_KEY_LEN: usize = 4 << 10;

/// Longest value a store accepts, in bytes (64 MiB). A [`StoreServer`] can be configured
/// lower with [`StoreServerBuilder::max_value_len`].
pub const MAX_VALUE_LEN: usize = 64 << 20;

/// Most keys one [`Store::wait`] may name.
pub const MAX_WAIT_KEYS: usize = 65_536;

/// A key-value store with deadlines, shared by the ranks of a job during setup.
///
/// All methods take `&self` and implementations are `Send + Sync`, so one store can be shared
/// by several threads. The trait is object safe: setup code takes `&dyn Store`.
///
/// What is *not* guaranteed: keys are not ordered, there is no notification of deletes, and a
/// value read by [`Store::get`] may already have been overwritten when it is returned.
pub trait Store: Send + Sync {
    /// Stores `value` under `key`, replacing any earlier value, and wakes waiters on it.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, waiting until some rank sets it or `deadline` passes
    /// ([`crate::ErrorKind::Timeout`]).
    fn get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>>;

    /// The value of `key` if it is set now; never waits.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Waits until every key in `keys` is set, or `deadline` passes
    /// ([`crate::ErrorKind::Timeout`]; the message names up to four missing keys).
    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()>;

    /// Atomically adds `delta` to the counter under `key` (a missing key counts as 0) and
    /// returns the new value. Fails with [`crate::ErrorKind::InvalidArgument`] if the key
    /// holds something other than a decimal `i64`, or on overflow.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Removes `key`; returns whether it was set.
    fn delete(&self, key: &str) -> Result<bool>;

    /// Atomically sets `key` to `new` if its current value is `expected` (`None`: the key is
    /// not set). Returns the value the key holds afterwards: `new` when the swap happened,
    /// otherwise the current value, or an empty vector when the key is not set (and `expected`
    /// was `Some`). To know whether you won, compare the result with `new`.
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<Vec<u8>>;

    /// Fails when this store knows that the job it serves has failed (a rank published its
    /// failure); never waits. Set-up steps that wait outside the store (a TCP accept) call it
    /// between waits, so they end with the failure instead of at their deadline. A plain store
    /// knows of no such thing and returns `Ok`.
    fn check_job(&self) -> Result<()> {
        Ok(())
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        (**self).get(key, deadline)
    }
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        (**self).try_get(key)
    }
    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        (**self).wait(keys, deadline)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        (**self).add(key, delta)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        (**self).delete(key)
    }
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<Vec<u8>> {
        (**self).compare_set(key, expected, new)
    }
    fn check_job(&self) -> Result<()> {
        (**self).check_job()
    }
}

impl<S: Store + ?Sized> Store for &S {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        (**self).get(key, deadline)
    }
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        (**self).try_get(key)
    }
    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        (**self).wait(keys, deadline)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        (**self).add(key, delta)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        (**self).delete(key)
    }
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<Vec<u8>> {
        (**self).compare_set(key, expected, new)
    }
}

/// A view of another store in which every key is prefixed with `"{prefix}/"`, so several
/// rendezvous (e.g. one per communicator) can share one store without colliding.
///
/// ```
/// use oxcomm::rendezvous::{InMemoryStore, PrefixStore, Store};
///
/// let store = InMemoryStore::new();
/// let world = PrefixStore::new("world", store.clone());
/// world.set("rank0", b"x")?;
/// assert_eq!(store.try_get("world/rank0")?, Some(b"x".to_vec()));
/// # Ok::<(), oxcomm::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PrefixStore<S> {
    prefix: String,
    inner: S,
}

impl<S: Store> PrefixStore<S> {
    /// Wraps `inner` so that key `k` is stored as `"{prefix}/{k}"`.
    pub fn new(prefix: impl Into<String>, inner: S) -> PrefixStore<S> {
        PrefixStore { prefix: prefix.into(), inner }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }
}

impl<S: Store> Store for PrefixStore<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), deadline)
    }
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.inner.try_get(&self.key(key))
    }
    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        let owned: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let keys: Vec<&str> = owned.iter().map(String::as_str).collect();
        self.inner.wait(&keys, deadline)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, new)
    }
}

/// A fresh shared secret for a job: 32 bytes from the operating system's random source, as 64
/// lowercase hex digits. A launcher puts it in `OXCOMM_TOKEN` (see [`env::OXCOMM_TOKEN`]) for
/// every rank; [`Settings`] decodes it back to the 32 bytes.
///
/// # Panics
///
/// If the operating system cannot provide random bytes (`getrandom` fails), which leaves no
/// safe way to make a secret.
pub fn generate_token() -> String {
    let mut bytes = [0u8; 32];
    if let Err(err) = getrandom::fill(&mut bytes) {
        panic!("oxcomm: the OS random source failed, cannot generate OXCOMM_TOKEN: {err}");
    }
    to_hex(&bytes)
}

/// Lowercase hex of `bytes`.
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

/// Decodes an even-length string of hex digits (either case); `None` if it is not one.
pub(crate) fn from_hex(s: &str) -> Option<Vec<u8>> {
    if s.is_empty() || s.len() % 2 != 0 {
        return None;
    }
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    s.as_bytes().chunks_exact(2).map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?)).collect()
}

/// Fills `buf` from the OS random source.
pub(crate) fn random_bytes(buf: &mut [u8]) -> Result<()> {
    getrandom::fill(buf)
        .map_err(|err| Error::new(crate::error::ErrorKind::Io, format!("the OS random source failed: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&bytes)).unwrap(), bytes);
        assert_eq!(from_hex("ABff"), Some(vec![0xab, 0xff]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
        assert_eq!(from_hex(""), None);
    }

    #[test]
    fn tokens_are_64_hex_digits_and_differ() {
        let a = generate_token();
        let b = generate_token();
        assert_eq!(a.len(), 64);
        assert_eq!(from_hex(&a).unwrap().len(), 32);
        assert_ne!(a, b);
    }
}
