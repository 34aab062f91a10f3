//! Moving bytes between this rank and one peer. Nothing here knows about collectives.
//!
//! # The contract
//!
//! A [`Link`] is a bidirectional, reliable, **ordered byte stream** between this rank and one
//! peer, driven without blocking: [`Link::try_send`] copies as many bytes as the link can take
//! now and [`Link::try_recv`] copies as many as have arrived. Message boundaries are not kept;
//! the layers above frame their own messages. Bytes are delivered exactly once, in order.
//!
//! Links never block and never wait. Waiting is done by the rank's [`Doorbell`]: every link
//! rings the doorbell of the *other* side whenever it makes bytes or space available, so a rank
//! that found no progress on any of its links can sleep on its own doorbell and be woken by
//! whichever peer moves first. A doorbell wait always has a deadline.
//!
//! After a link returns an error it is unusable; the communicator above aborts.
//! [`Link::check_peer`] is how a waiting rank notices that a peer is gone (process died,
//! connection closed) before its deadline.

use std::time::Instant;

use crate::error::Result;

#[cfg(target_os = "linux")]
pub mod shm;
#[cfg(unix)]
pub mod tcp;
pub mod threads;

/// A bidirectional ordered byte stream to one peer. See the [module docs](self).
pub trait Link: Send {
    /// The peer's rank (in the world this link was built for).
    fn peer(&self) -> usize;

    /// Copies a prefix of `data` into the link; returns how many bytes were taken (0 when the
    /// link is full right now). Rings the peer's doorbell when it took any.
    fn try_send(&mut self, data: &[u8]) -> Result<usize>;

    /// Copies available bytes into a prefix of `buf`; returns how many (0 when none arrived
    /// yet). Rings the peer's doorbell when it freed space.
    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize>;

    /// Offers bytes that have arrived, in place where the transport can, to `consume`, which
    /// must use every byte it is offered (it may be called several times). At most `max` bytes
    /// are offered in all; returns how many. The default copies through a stack buffer;
    /// transports with mapped memory offer it without a copy.
    fn recv_with(&mut self, max: usize, consume: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let mut scratch = [0u8; 4096];
        let want = max.min(scratch.len());
        let got = self.try_recv(&mut scratch[..want])?;
        if got > 0 {
            consume(&scratch[..got]);
        }
        Ok(got)
    }

    /// Returns an error of kind [`crate::ErrorKind::PeerGone`] if the peer is known to be
    /// gone. Cheap enough to call every few milliseconds while waiting.
    fn check_peer(&mut self) -> Result<()>;

    /// A short name of the transport ("threads", "shm", "tcp"), for logs and plans.
    fn kind(&self) -> &'static str;
}

/// How one rank sleeps until any peer makes progress for it.
///
/// The doorbell is a counter that peers increment (ring) after making bytes or space available
/// to this rank. A waiter reads [`Doorbell::epoch`], re-checks its links, and only then calls
/// [`Doorbell::wait`] with the epoch it read, so a ring in between is never lost.
pub trait Doorbell: Send + Sync {
    /// The current count.
    fn epoch(&self) -> u32;
    /// Sleeps until the count differs from `epoch` or `until` has passed (spurious early
    /// returns are allowed). Implementations spin briefly before sleeping.
    fn wait(&self, epoch: u32, until: Instant);
}
