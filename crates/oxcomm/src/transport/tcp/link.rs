//! [`TcpLink`] and [`TcpDoorbell`]: the [transport contract](crate::transport) over connected,
//! authenticated, non-blocking TCP sockets.
//!
//! This file owns the data path after the handshake: framing the byte stream into data
//! frames ([`super::frame`]), the non-blocking send and receive calls, peer-loss detection and
//! the poll-based doorbell. It knows nothing about how the sockets were connected.
//!
//! The design (no I/O threads, one-shot interest polled by the doorbell) is described in the
//! [TCP module docs](crate::transport::tcp).
//!
//! Over 600 lines on purpose: the link and the doorbell are the two halves of one protocol,
//! the one-shot interest in [`Shared`] (a link arms read/write interest when a call would
//! block, the doorbell's poll consumes it), and each half's ordering argument refers to the
//! other's lines. Should either grow, the seam is `TcpDoorbell` into its own file, with
//! `Shared` as the only thing both import.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendFlags};

use super::frame::{self, HEADER_BYTES, TAG_BEAT, TAG_CTRL, TAG_DATA, TAG_MARK};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{Doorbell, Link};

/// Bytes of a link's receive staging buffer (headers and small pieces are read through it).
pub(crate) const STAGE_BYTES: usize = 64 << 10;
/// Reads of at least this many payload bytes go straight into the caller's buffer.
const DIRECT_MIN: usize = 16 << 10;

/// Interest bits.
const WANT_READ: u8 = 1;
const WANT_WRITE: u8 = 2;

/// What a link and the doorbell share: the socket and the link's interest.
pub(crate) struct Shared {
    pub(crate) sock: TcpStream,
    interest: AtomicU8,
    /// Control frames the link has taken off the stream so far (the doorbell's
    /// [`Doorbell::ctrl_count`] adds them up).
    ctrl: AtomicU32,
}

impl Shared {
    pub(crate) fn new(sock: TcpStream) -> Arc<Shared> {
        Arc::new(Shared { sock, interest: AtomicU8::new(0), ctrl: AtomicU32::new(0) })
    }

    fn want(&self, bits: u8) {
        self.interest.fetch_or(bits, Ordering::SeqCst);
    }
}

/// This rank's end of a TCP connection to one peer. See the [module docs](crate::transport::tcp).
///
/// Every outgoing piece of payload travels in a data frame whose 24-byte header is checked by
/// the receiver (magic, version, tag, sequence number, length bound, check word); a peer that
/// breaks the framing gets an [`ErrorKind::Protocol`] error, a closed or reset connection
/// [`ErrorKind::PeerGone`] naming the peer. Dropping the link shuts the connection down, so
/// the peer notices at once.
pub struct TcpLink {
    rank: usize,
    peer: usize,
    /// World size: an abort frame naming a rank at or above it is a protocol error.
    world: usize,
    shared: Arc<Shared>,
    /// Largest payload of an outgoing frame.
    frame_bytes: usize,
    // Sending.
    send_seq: u64,
    /// Header of the open outgoing frame and how much of it is written.
    header: [u8; HEADER_BYTES],
    header_sent: usize,
    /// Payload bytes the open outgoing frame still expects.
    send_left: usize,
    // Receiving.
    recv_seq: u64,
    /// Payload bytes of the current incoming frame not yet handed out (staged ones included).
    recv_left: usize,
    stage: Box<[u8]>,
    stage_at: usize,
    stage_end: usize,
    /// Payload bytes a [`Link::peek`] took off the stream, handed out before any other.
    peeked: Vec<u8>,
    /// The first error; the link is unusable after it.
    failed: Option<Error>,
    /// Fault tolerance: control frames, epoch marks, heartbeats (see [`Ft`]).
    ft: Ft,
}

/// What a TCP link keeps for fault tolerance: control messages that arrived, the epochs of
/// both directions, control frames waiting to go out, and what it knows of the peer's life.
struct Ft {
    /// Control messages taken off the stream, for [`Link::recv_ctrl`].
    ctrl_in: std::collections::VecDeque<Vec<u8>>,
    /// The peer's last epoch mark seen: data frames after it wait for [`Link::begin_epoch`].
    mark_in: u32,
    /// The epoch this side reads: data of it is delivered.
    epoch_in: u32,
    /// The epoch [`Link::begin_epoch`] drops the stream up to, while its mark has not come.
    skip_to: Option<u32>,
    /// The last epoch this side marked ([`Link::end_epoch`]).
    mark_out: u32,
    /// Encoded control frames (marks, control messages, heartbeats) not yet written; data
    /// frames wait for them.
    out: Vec<u8>,
    out_at: usize,
    /// When this side last queued a heartbeat (monotonic ns).
    beat_sent: u64,
    /// The op word of the peer's last heartbeat, if any came.
    beat_op: Option<u64>,
    /// What the receive side looked like at the last [`Link::peer_idle`], and when it last
    /// changed: any frame taken, any byte arrived, counts as a sign of life.
    heard: (u64, usize, usize, usize, usize, usize),
    heard_at: u64,
}

/// Most control messages a link holds that nobody took yet (a peer sending more is breaking
/// the protocol: every exchange of control messages waits for answers).
const MAX_CTRL_QUEUED: usize = 1024;

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink")
            .field("rank", &self.rank)
            .field("peer", &self.peer)
            .field("local", &self.shared.sock.local_addr().ok())
            .field("remote", &self.shared.sock.peer_addr().ok())
            .finish_non_exhaustive()
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.shared.interest.store(0, Ordering::SeqCst);
        let _ = self.shared.sock.shutdown(Shutdown::Both);
    }
}

impl TcpLink {
    /// Wraps an authenticated, non-blocking socket.
    pub(crate) fn new(rank: usize, peer: usize, world: usize, shared: Arc<Shared>, frame_bytes: usize) -> TcpLink {
        TcpLink {
            rank,
            peer,
            world,
            shared,
            frame_bytes: frame_bytes.clamp(1, frame::MAX_FRAME_BYTES),
            send_seq: 0,
            header: [0; HEADER_BYTES],
            header_sent: HEADER_BYTES,
            send_left: 0,
            recv_seq: 0,
            recv_left: 0,
            stage: vec![0u8; STAGE_BYTES].into_boxed_slice(),
            stage_at: 0,
            stage_end: 0,
            peeked: Vec::new(),
            failed: None,
            ft: Ft {
                ctrl_in: std::collections::VecDeque::new(),
                mark_in: 0,
                epoch_in: 0,
                skip_to: None,
                mark_out: 0,
                out: Vec::new(),
                out_at: 0,
                beat_sent: 0,
                beat_op: None,
                heard: (0, 0, 0, 0, 0, 0),
                heard_at: crate::clock::monotonic_ns(),
            },
        }
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Writes `bytes` to the socket as they are, bypassing the framing, waiting (up to
    /// `deadline`) for room. Only for tests that need a peer breaking the protocol; the link
    /// is unusable for data afterwards.
    #[doc(hidden)]
    pub fn inject_raw(&mut self, mut bytes: &[u8], deadline: Instant) -> Result<()> {
        while !bytes.is_empty() {
            match rustix::net::send(&self.shared.sock, bytes, SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
                Ok(n) => bytes = &bytes[n..],
                Err(Errno::AGAIN) | Err(Errno::INTR) => {
                    if Instant::now() >= deadline {
                        return Err(Error::new(ErrorKind::Timeout, "inject_raw: the socket stayed full"));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(self.os_error("sending to", e)),
            }
        }
        Ok(())
    }

    /// The socket's local address, if the OS still knows it.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.shared.sock.local_addr().ok()
    }

    /// The peer's address, if the OS still knows it.
    pub fn peer_addr(&self) -> Option<std::net::SocketAddr> {
        self.shared.sock.peer_addr().ok()
    }

    fn fail(&mut self, err: Error) -> Error {
        let err = err.with_peer(self.peer).with_rank(self.rank);
        if self.failed.is_none() {
            tracing::debug!(target: "oxcomm::tcp", rank = self.rank, peer = self.peer, error = %err, "link failed");
            self.failed = Some(err.clone());
        }
        err
    }

    fn check_failed(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn gone(&self, why: impl std::fmt::Display) -> Error {
        Error::new(ErrorKind::PeerGone, format!("rank {} is gone ({why})", self.peer))
    }

    fn os_error(&self, what: &str, e: Errno) -> Error {
        match e {
            Errno::PIPE
            | Errno::CONNRESET
            | Errno::CONNABORTED
            | Errno::NOTCONN
            | Errno::TIMEDOUT
            | Errno::HOSTUNREACH
            | Errno::NETUNREACH => self.gone(format!("{what}: {}", std::io::Error::from(e))),
            _ => Error::new(ErrorKind::Io, format!("{what} rank {}: {}", self.peer, std::io::Error::from(e))),
        }
    }

    fn closed(&self) -> Error {
        if self.recv_left > 0 {
            self.gone(format!("it closed the connection in the middle of frame {}", self.recv_seq.wrapping_sub(1)))
        } else {
            self.gone("it closed the connection")
        }
    }

    /// Moves bytes an earlier peek took off the stream into a prefix of `buf`; returns how many.
    fn take_peeked(&mut self, buf: &mut [u8]) -> usize {
        if self.peeked.is_empty() {
            return 0;
        }
        let n = buf.len().min(self.peeked.len());
        buf[..n].copy_from_slice(&self.peeked[..n]);
        self.peeked.drain(..n);
        n
    }

    fn staged(&self) -> usize {
        self.stage_end - self.stage_at
    }

    /// Reads what the socket has into the staging buffer (after moving staged bytes to its
    /// front). `Ok(false)`: nothing available now.
    fn fill_stage(&mut self) -> Result<bool> {
        if self.stage_at > 0 {
            self.stage.copy_within(self.stage_at..self.stage_end, 0);
            self.stage_end -= self.stage_at;
            self.stage_at = 0;
        }
        let end = self.stage_end;
        loop {
            match rustix::net::recv(&self.shared.sock, &mut self.stage[end..], RecvFlags::DONTWAIT) {
                Ok((0, _)) => return Err(self.closed()),
                Ok((n, _)) => {
                    self.stage_end += n;
                    return Ok(true);
                }
                Err(Errno::AGAIN) => return Ok(false),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(self.os_error("receiving from", e)),
            }
        }
    }

    /// Makes sure an incoming frame is open (`recv_left > 0`), reading and checking its header
    /// if needed. `Ok(false)`: the header has not fully arrived yet.
    fn open_frame(&mut self) -> Result<bool> {
        while self.recv_left == 0 {
            if self.staged() < HEADER_BYTES {
                if !self.fill_stage()? {
                    return Ok(false);
                }
                continue;
            }
            let bytes: &[u8; HEADER_BYTES] =
                self.stage[self.stage_at..self.stage_at + HEADER_BYTES].try_into().unwrap_or_else(|_| unreachable!());
            let header = frame::decode(bytes, self.recv_seq)
                .map_err(|e| Error::protocol(format!("from rank {}: {}", self.peer, e.message())))?;
            if header.abort {
                let (culprit, code) = frame::decode_abort(header.len, self.world).map_err(|e| {
                    self.fail(Error::protocol(format!("from rank {}: {}", self.peer, e.message())).with_peer(self.peer))
                })?;
                let err = if culprit == self.peer {
                    self.gone("it aborted after failing")
                } else {
                    crate::transport::cascaded_to(self.rank, self.peer, culprit, code)
                };
                return Err(self.fail(err));
            }
            if header.tag != TAG_DATA {
                if !self.take_control_frame(header.tag, header.len)? {
                    return Ok(false);
                }
                continue;
            }
            if self.ft.mark_in > self.ft.epoch_in && self.ft.skip_to.is_none() {
                // A newer epoch's data: it waits for `begin_epoch` (an op of the old epoch
                // never reads it).
                return Ok(false);
            }
            self.stage_at += HEADER_BYTES;
            self.recv_seq += 1;
            self.recv_left = header.len as usize;
        }
        Ok(true)
    }

    fn recv_inner(&mut self, buf: &mut [u8]) -> Result<usize> {
        let mut got = 0;
        while got < buf.len() {
            if !self.open_frame()? {
                break;
            }
            let want = (buf.len() - got).min(self.recv_left);
            if self.staged() > 0 {
                let n = want.min(self.staged());
                buf[got..got + n].copy_from_slice(&self.stage[self.stage_at..self.stage_at + n]);
                self.stage_at += n;
                self.recv_left -= n;
                got += n;
                continue;
            }
            if want < DIRECT_MIN {
                // Small pieces come through the stage, many frames per call.
                if !self.fill_stage()? {
                    break;
                }
                continue;
            }
            // Large piece with nothing staged: straight into the caller's buffer.
            let tail = want == self.recv_left;
            let n = self.recv_direct(&mut buf[got..got + want], tail)?;
            self.recv_left -= n;
            got += n;
            if n < want {
                break; // the socket is drained; don't pay a syscall to learn that
            }
        }
        Ok(got)
    }

    /// Reads up to `dst.len()` payload bytes straight into `dst` (nothing is staged). With
    /// `tail` (`dst` ends the open frame), the same call reads the next frame's header, as
    /// far as it has arrived, into the empty stage, so that a stream of large frames never
    /// passes payload through the stage (one `recvmsg` per piece, no copy but the kernel's).
    /// Returns the payload bytes read (0: none available now).
    fn recv_direct(&mut self, dst: &mut [u8], tail: bool) -> Result<usize> {
        debug_assert_eq!(self.staged(), 0);
        self.stage_at = 0;
        self.stage_end = 0;
        loop {
            let res = if tail {
                let mut iov = [IoSliceMut::new(&mut *dst), IoSliceMut::new(&mut self.stage[..HEADER_BYTES])];
                rustix::net::recvmsg(
                    &self.shared.sock,
                    &mut iov,
                    &mut RecvAncillaryBuffer::default(),
                    RecvFlags::DONTWAIT,
                )
                .map(|m| m.bytes)
            } else {
                rustix::net::recv(&self.shared.sock, &mut *dst, RecvFlags::DONTWAIT).map(|(n, _)| n)
            };
            match res {
                Ok(0) => return Err(self.closed()),
                Ok(n) => {
                    let payload = n.min(dst.len());
                    self.stage_end = n - payload;
                    return Ok(payload);
                }
                Err(Errno::AGAIN) => return Ok(0),
                Err(Errno::INTR) => {}
                Err(e) => return Err(self.os_error("receiving from", e)),
            }
        }
    }

    fn send_inner(&mut self, data: &[u8]) -> Result<usize> {
        if self.send_left == 0 {
            let len = data.len().min(self.frame_bytes);
            self.header = frame::encode(self.send_seq, len as u32);
            self.header_sent = 0;
            self.send_seq += 1;
            self.send_left = len;
        }
        let take = data.len().min(self.send_left);
        loop {
            let pending = &self.header[self.header_sent..];
            let iov = [IoSlice::new(pending), IoSlice::new(&data[..take])];
            let iov = if pending.is_empty() { &iov[1..] } else { &iov[..] };
            let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
            match rustix::net::sendmsg(&self.shared.sock, iov, &mut SendAncillaryBuffer::default(), flags) {
                Ok(n) => {
                    let h = n.min(pending.len());
                    self.header_sent += h;
                    let payload = n - h;
                    self.send_left -= payload;
                    if payload > 0 {
                        return Ok(payload);
                    }
                    // Only (part of) the header went out: try again, the socket will either
                    // take more or say it is full (and we register interest).
                }
                Err(Errno::AGAIN) => {
                    self.shared.want(WANT_WRITE);
                    return Ok(0);
                }
                Err(Errno::INTR) => {}
                Err(e) => return Err(self.os_error("sending to", e)),
            }
        }
    }

    /// Whether the peer has closed or reset the connection with nothing left to read.
    /// Whether the unread end of the stream of a peer that closed is an abort frame: then it
    /// was alive when it failed, and the reader is to find its cause there. Only called once
    /// the peer has closed, so everything it sent is here.
    fn ends_with_abort(&self) -> bool {
        self.ends_with_abort_word(None)
    }

    /// Whether the unread end of the stream is an abort frame (with word `word`, if given).
    fn ends_with_abort_word(&self, want: Option<u32>) -> bool {
        let pending = rustix::io::ioctl_fionread(&self.shared.sock).unwrap_or(0) as usize;
        let mut unread = self.stage[self.stage_at..self.stage_end].to_vec();
        let at = unread.len();
        unread.resize(at + pending, 0);
        match rustix::net::recv(&self.shared.sock, &mut unread[at..], RecvFlags::DONTWAIT | RecvFlags::PEEK) {
            Ok((n, _)) => unread.truncate(at + n),
            Err(_) => unread.truncate(at),
        }
        let Some(tail) = unread.len().checked_sub(HEADER_BYTES).map(|from| &unread[from..]) else { return false };
        let seq = u64::from_le_bytes(tail[8..16].try_into().expect("8 bytes"));
        let word = u32::from_le_bytes(tail[16..20].try_into().expect("4 bytes"));
        want.is_none_or(|w| w == word) && tail == frame::encode_raw(frame::TAG_ABORT, seq, word)
    }

    fn peer_closed(&self) -> Result<()> {
        if self.staged() > 0 || !self.peeked.is_empty() {
            return Ok(());
        }
        let mut probe = [0u8; 1];
        loop {
            match rustix::net::recv(&self.shared.sock, &mut probe[..], RecvFlags::DONTWAIT | RecvFlags::PEEK) {
                Ok((0, _)) => return Err(self.closed()),
                Ok(_) | Err(Errno::AGAIN) => return Ok(()),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(self.os_error("checking", e)),
            }
        }
    }
}

impl Link for TcpLink {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        self.check_failed()?;
        if data.is_empty() {
            return Ok(0);
        }
        // Control frames queued between data frames go first.
        if self.ft.out_at < self.ft.out.len() && !self.flush_control().map_err(|e| self.fail(e))? {
            return Ok(0);
        }
        let n = self.send_inner(data).map_err(|e| self.fail(e))?;
        if n < data.len() {
            // The socket is full (or nearly): wake the next wait when it has room again.
            self.shared.want(WANT_WRITE);
        }
        Ok(n)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.check_failed()?;
        if buf.is_empty() {
            return Ok(0);
        }
        // Whatever this call finds, the next wait watches this socket: a caller may wait for
        // more after a partial (or even a full) read, and the next bytes must wake it.
        self.shared.want(WANT_READ);
        let early = self.take_peeked(buf);
        if early == buf.len() {
            return Ok(early);
        }
        let n = self.recv_inner(&mut buf[early..]).map(|n| early + n).map_err(|e| self.fail(e))?;
        self.take_staged_control();
        Ok(n)
    }

    fn peek(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.check_failed()?;
        self.shared.want(WANT_READ); // as in try_recv: a short peek waits for more
        if self.peeked.len() < buf.len() {
            let mut peeked = std::mem::take(&mut self.peeked);
            let at = peeked.len();
            peeked.resize(buf.len(), 0);
            let got = self.recv_inner(&mut peeked[at..]);
            peeked.truncate(at + *got.as_ref().unwrap_or(&0));
            self.peeked = peeked;
            got.map_err(|e| self.fail(e))?;
        }
        let n = self.peeked.len().min(buf.len());
        buf[..n].copy_from_slice(&self.peeked[..n]);
        Ok(n)
    }

    fn recv_with(&mut self, max: usize, consume: &mut dyn FnMut(&[u8])) -> Result<usize> {
        self.check_failed()?;
        if max > 0 {
            self.shared.want(WANT_READ); // as in try_recv
        }
        let mut got = 0;
        if !self.peeked.is_empty() && max > 0 {
            let n = max.min(self.peeked.len());
            consume(&self.peeked[..n]);
            self.peeked.drain(..n);
            got = n;
        }
        while got < max {
            match self.open_frame() {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => return Err(self.fail(e)),
            }
            if self.staged() == 0 {
                match self.fill_stage() {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => return Err(self.fail(e)),
                }
            }
            let n = (max - got).min(self.recv_left).min(self.staged());
            consume(&self.stage[self.stage_at..self.stage_at + n]);
            self.stage_at += n;
            self.recv_left -= n;
            got += n;
        }
        Ok(got)
    }

    fn check_peer(&mut self) -> Result<()> {
        self.check_failed()?;
        self.peer_closed().map_err(|e| self.fail(e))
    }

    fn check_alive(&mut self) -> Result<()> {
        self.check_failed()?;
        // Bytes the peer sent before it went may still be unread (the peek of `check_peer`
        // sees those); the end of its side of the stream shows as RDHUP all the same.
        let mut fds = [PollFd::from_borrowed_fd(self.shared.sock.as_fd(), PollFlags::RDHUP)];
        let now = Timespec { tv_sec: 0, tv_nsec: 0 };
        let ended = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR;
        if matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0)
            && fds[0].revents().intersects(ended)
            && !self.ends_with_abort()
        {
            let e = self.gone("it closed the connection");
            return Err(self.fail(e));
        }
        self.check_peer()
    }

    fn close(&mut self, cause: Option<(usize, ErrorKind)>) {
        // Tell the peer who caused this, if no data frame is half-sent (best effort: a full
        // socket just closes without the notice).
        if let Some((culprit, kind)) = cause {
            if self.at_frame_boundary() && self.ft.out_at == self.ft.out.len() {
                let word = (culprit as u32) << 3 | crate::transport::cause_code(kind);
                let h = frame::encode_raw(frame::TAG_ABORT, self.send_seq, word);
                let _ = rustix::net::send(&self.shared.sock, &h, SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
            }
        }
    }

    fn kind(&self) -> crate::transport::Transport {
        crate::transport::Transport::Tcp
    }

    fn send_ctrl(&mut self, msg: &[u8]) -> Result<bool> {
        self.check_failed()?;
        if msg.is_empty() || msg.len() > crate::transport::MAX_CTRL_BYTES {
            return Err(Error::invalid(format!("a control message of {} bytes", msg.len())));
        }
        if !self.at_frame_boundary() {
            return Ok(false); // a data frame is half sent: after it
        }
        self.queue_frame(TAG_CTRL, msg.len() as u32, msg);
        self.flush_control().map_err(|e| self.fail(e))?;
        Ok(true)
    }

    fn recv_ctrl(&mut self, out: &mut Vec<u8>) -> Result<bool> {
        // Control messages read before the connection failed still come out: a peer that
        // revokes and exits at once leaves its revocation just ahead of the close, and a read
        // of data may have taken both off the socket.
        if self.failed.is_none() {
            let read = match self.flush_control() {
                Ok(_) if self.ft.ctrl_in.is_empty() => self.read_control(),
                other => other.map(|_| ()),
            };
            if let Err(e) = read {
                self.fail(e);
            }
        }
        match self.ft.ctrl_in.pop_front() {
            Some(m) => {
                *out = m;
                Ok(true)
            }
            None => {
                self.check_failed()?;
                self.shared.want(WANT_READ);
                Ok(false)
            }
        }
    }

    fn end_epoch(&mut self, epoch: u32) -> Result<bool> {
        self.check_failed()?;
        if self.ft.mark_out < epoch {
            // Complete a half-sent data frame with padding (the peer drops it), then mark.
            let zeros = [0u8; 4096];
            while !self.at_frame_boundary() {
                let n = self.send_left.min(zeros.len()).max(1);
                if self.send_inner(&zeros[..n]).map_err(|e| self.fail(e))? == 0 && !self.at_frame_boundary() {
                    self.shared.want(WANT_WRITE);
                    return Ok(false);
                }
            }
            self.queue_frame(TAG_MARK, epoch, &[]);
            self.ft.mark_out = epoch;
        }
        self.flush_control().map_err(|e| self.fail(e))
    }

    fn begin_epoch(&mut self, epoch: u32) -> Result<bool> {
        self.check_failed()?;
        if self.ft.epoch_in >= epoch {
            return Ok(true);
        }
        if self.ft.mark_in >= epoch {
            // The mark came while an op of the old epoch read: what is after it is the new.
            self.ft.epoch_in = epoch;
            self.ft.skip_to = None;
            return Ok(true);
        }
        self.ft.skip_to = Some(epoch);
        self.peeked.clear();
        self.read_control().map_err(|e| self.fail(e))?;
        Ok(self.ft.epoch_in >= epoch)
    }

    fn beat(&mut self, op: u64) {
        if self.failed.is_some() || !self.at_frame_boundary() || self.ft.out_at < self.ft.out.len() {
            return;
        }
        let now = crate::clock::monotonic_ns();
        if now.saturating_sub(self.ft.beat_sent) < crate::transport::BEAT_EVERY.as_nanos() as u64 {
            return;
        }
        self.ft.beat_sent = now;
        self.queue_frame(TAG_BEAT, frame::BEAT_BYTES as u32, &op.to_le_bytes());
        if let Err(e) = self.flush_control() {
            self.fail(e);
        }
    }

    fn left_out_by_peer(&mut self) -> bool {
        let mut fds = [PollFd::from_borrowed_fd(self.shared.sock.as_fd(), PollFlags::RDHUP)];
        let now = Timespec { tv_sec: 0, tv_nsec: 0 };
        let ended = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR;
        if !(matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0) && fds[0].revents().intersects(ended)) {
            return false;
        }
        let word = (self.rank as u32) << 3 | crate::transport::cause_code(ErrorKind::Revoked);
        self.ends_with_abort_word(Some(word))
    }

    fn peer_idle(&mut self) -> Option<Duration> {
        // Any frame taken or any byte arrived since the last look is a sign of life. Bytes
        // that sit unread hide the heartbeats behind them: then this side cannot tell.
        let unread = rustix::io::ioctl_fionread(&self.shared.sock).unwrap_or(0) as usize;
        let now = (
            self.recv_seq,
            self.recv_left,
            self.stage_at,
            self.stage_end,
            self.peeked.len() + self.ft.ctrl_in.len(),
            unread,
        );
        if now != self.ft.heard {
            self.ft.heard = now;
            self.ft.heard_at = crate::clock::monotonic_ns();
        } else if unread > 0 || (self.staged() > 0 && self.recv_left > 0) {
            return None;
        }
        crate::clock::idle_since(self.ft.heard_at)
    }

    fn peer_last_op(&mut self) -> Option<u64> {
        self.ft.beat_op
    }

    fn renumber(&mut self, rank: usize, peer: usize, world: usize) {
        self.rank = rank;
        self.peer = peer;
        self.world = world;
    }
}

impl TcpLink {
    /// Whether no data frame is half sent (a control frame may go now).
    fn at_frame_boundary(&self) -> bool {
        self.send_left == 0 && self.header_sent == HEADER_BYTES
    }

    /// Appends a frame of kind `tag` (header with `len`, then `payload`) to the control frames
    /// waiting to go out.
    fn queue_frame(&mut self, tag: u8, len: u32, payload: &[u8]) {
        if self.ft.out_at == self.ft.out.len() {
            self.ft.out.clear();
            self.ft.out_at = 0;
        }
        self.ft.out.extend_from_slice(&frame::encode_raw(tag, self.send_seq, len));
        self.ft.out.extend_from_slice(payload);
        self.send_seq += 1;
    }

    /// Writes what it can of the control frames waiting; `Ok(true)` once none waits.
    fn flush_control(&mut self) -> Result<bool> {
        while self.ft.out_at < self.ft.out.len() {
            let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
            match rustix::net::send(&self.shared.sock, &self.ft.out[self.ft.out_at..], flags) {
                Ok(n) => self.ft.out_at += n,
                Err(Errno::AGAIN) => {
                    self.shared.want(WANT_WRITE);
                    return Ok(false);
                }
                Err(Errno::INTR) => {}
                Err(e) => return Err(self.os_error("sending to", e)),
            }
        }
        Ok(true)
    }

    /// Takes a control frame (`tag` is not data) whose header is staged: a mark is noted, a
    /// control message queued for [`Link::recv_ctrl`], a heartbeat's op word kept. `Ok(false)`
    /// while its payload has not all arrived (the header stays staged).
    fn take_control_frame(&mut self, tag: u8, len: u32) -> Result<bool> {
        let body = if tag == TAG_MARK { 0 } else { len as usize };
        while self.staged() < HEADER_BYTES + body {
            if !self.fill_stage()? {
                return Ok(false);
            }
        }
        let at = self.stage_at + HEADER_BYTES;
        match tag {
            TAG_MARK => {
                self.ft.mark_in = self.ft.mark_in.max(len);
                if let Some(to) = self.ft.skip_to.filter(|to| self.ft.mark_in >= *to) {
                    self.ft.epoch_in = to;
                    self.ft.skip_to = None;
                }
            }
            TAG_CTRL => {
                if self.ft.ctrl_in.len() >= MAX_CTRL_QUEUED {
                    return Err(Error::protocol(format!(
                        "rank {} sent more than {MAX_CTRL_QUEUED} control messages nobody took",
                        self.peer
                    )));
                }
                self.ft.ctrl_in.push_back(self.stage[at..at + body].to_vec());
                self.shared.ctrl.fetch_add(1, Ordering::AcqRel);
            }
            TAG_BEAT => {
                let word: [u8; 8] = self.stage[at..at + 8].try_into().expect("8 bytes");
                self.ft.beat_op = Some(u64::from_le_bytes(word));
            }
            _ => unreachable!("decode accepts only these tags"),
        }
        self.stage_at += HEADER_BYTES + body;
        self.recv_seq += 1;
        Ok(true)
    }

    /// After a read: a control frame whose header already sits in the stage behind the data
    /// just read is taken now, so that the op that read the data learns of it from memory
    /// (a peer's control message right behind its last data: a revocation) before it returns.
    fn take_staged_control(&mut self) {
        if self.recv_left == 0 && self.staged() >= HEADER_BYTES && self.stage[self.stage_at + 5] != TAG_DATA {
            if let Err(e) = self.open_frame() {
                self.fail(e);
            }
        }
    }

    /// Reads the stream as far as control frames go: takes every control frame, and while
    /// [`Link::begin_epoch`] drops the old epoch, drops its data frames too. Stops at data
    /// the reader must take, or when nothing more has arrived.
    fn read_control(&mut self) -> Result<()> {
        loop {
            if self.recv_left > 0 {
                if self.ft.skip_to.is_none() {
                    return Ok(());
                }
                // Drop the old epoch's payload.
                if self.staged() == 0 && !self.fill_stage()? {
                    return Ok(());
                }
                let n = self.recv_left.min(self.staged());
                self.stage_at += n;
                self.recv_left -= n;
                continue;
            }
            if !self.open_frame()? {
                return Ok(());
            }
            if self.ft.skip_to.is_none() {
                return Ok(()); // a data frame of the current epoch: the reader's
            }
        }
    }
}

/// Links with more peers than this poll through a heap-allocated list.
const STACK_POLL_FDS: usize = 64;

/// A rank's doorbell for TCP links: polls the sockets of its links that could not move (see
/// the [module docs](crate::transport::tcp)) and a wake-up pipe. The count rises each time a wait saw a socket
/// become ready, and on every [`TcpDoorbell::ring`].
///
/// A wait first polls without sleeping for up to [`TcpConfig::spin`](super::TcpConfig::spin)
/// (yielding the core between polls), then sleeps in `poll(2)`, never past its deadline. It
/// spins only while this host has a core for every runnable task (`HostLoad`), unless
/// [`TcpConfig::spin_loaded`](super::TcpConfig::spin_loaded) says to spin anyway: a waiter that
/// spins on a shared core takes it from the rank it waits for.
pub struct TcpDoorbell {
    links: Vec<Arc<Shared>>,
    wake_rx: UnixStream,
    wake_tx: UnixStream,
    epoch: AtomicU32,
    spin: Duration,
    spin_loaded: bool,
    load: HostLoad,
}

/// Whether this host has a core for every runnable task, sampled from `/proc/loadavg` (its
/// fourth field counts the tasks running or ready to run, this one included) at most every
/// [`HostLoad::EVERY`]; elsewhere, or if it cannot be read, the host counts as loaded (no
/// spinning). It answers for the machine as a whole, so ranks of several "hosts" that share
/// one machine (containers, network namespaces) see each other.
#[derive(Debug)]
pub(crate) struct HostLoad {
    cores: usize,
    /// `monotonic_ns` of the last sample (0: never).
    sampled_at: AtomicU64,
    idle_core: AtomicBool,
}

impl HostLoad {
    /// How long a sample stands.
    const EVERY: Duration = Duration::from_millis(10);

    pub(crate) fn new() -> HostLoad {
        HostLoad {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            sampled_at: AtomicU64::new(0),
            idle_core: AtomicBool::new(false),
        }
    }

    /// Whether every runnable task has a core now (within [`HostLoad::EVERY`]).
    pub(crate) fn has_core_per_task(&self) -> bool {
        let now = crate::clock::monotonic_ns().max(1);
        let at = self.sampled_at.load(Ordering::Relaxed);
        if at == 0 || now.saturating_sub(at) >= Self::EVERY.as_nanos() as u64 {
            self.sampled_at.store(now, Ordering::Relaxed);
            let runnable = std::fs::read_to_string("/proc/loadavg").ok().and_then(|s| runnable_tasks(&s));
            self.idle_core.store(runnable.is_some_and(|r| r <= self.cores), Ordering::Relaxed);
        }
        self.idle_core.load(Ordering::Relaxed)
    }
}

/// The runnable-task count of a `/proc/loadavg` line (`0.52 0.58 0.59 3/467 1234`: 3).
pub(crate) fn runnable_tasks(loadavg: &str) -> Option<usize> {
    loadavg.split_whitespace().nth(3)?.split('/').next()?.parse().ok()
}

impl std::fmt::Debug for TcpDoorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpDoorbell")
            .field("links", &self.links.len())
            .field("spin", &self.spin)
            .field("spin_loaded", &self.spin_loaded)
            .finish_non_exhaustive()
    }
}

impl TcpDoorbell {
    /// A doorbell over no links yet (see [`TcpDoorbell::set_links`]) whose waits spin for up
    /// to `spin` first (only on an unloaded host, unless `spin_loaded`).
    pub(crate) fn new(spin: Duration, spin_loaded: bool) -> Result<TcpDoorbell> {
        let (wake_rx, wake_tx) =
            UnixStream::pair().map_err(|e| Error::io("creating the doorbell's wake-up pipe", e))?;
        for s in [&wake_rx, &wake_tx] {
            s.set_nonblocking(true).map_err(|e| Error::io("creating the doorbell's wake-up pipe", e))?;
        }
        Ok(TcpDoorbell {
            links: Vec::new(),
            wake_rx,
            wake_tx,
            epoch: AtomicU32::new(0),
            spin,
            spin_loaded,
            load: HostLoad::new(),
        })
    }

    /// The links whose sockets this doorbell polls.
    pub(crate) fn set_links(&mut self, links: Vec<Arc<Shared>>) {
        self.links = links;
    }

    /// Increments the count and wakes a waiter, e.g. to interrupt this rank's own wait from
    /// another thread.
    pub fn ring(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        // A full pipe already holds a wake-up; nothing else can fail that matters here.
        let _ = (&self.wake_tx).write(&[1]);
    }

    /// One poll of the interested sockets, sleeping at most `timeout`. Returns whether
    /// anything was ready (the count is raised then).
    fn poll_once(&self, timeout: Duration) -> bool {
        let wake_fd = self.wake_rx.as_fd();
        let mut stack_fds: [PollFd<'_>; STACK_POLL_FDS];
        let mut heap_fds: Vec<PollFd<'_>>;
        let mut stack_idx = [0usize; STACK_POLL_FDS];
        let mut heap_idx: Vec<usize>;
        let (fds, idx): (&mut [PollFd<'_>], &mut [usize]) = if self.links.len() < STACK_POLL_FDS {
            stack_fds = std::array::from_fn(|_| PollFd::from_borrowed_fd(wake_fd, PollFlags::empty()));
            (&mut stack_fds[..], &mut stack_idx[..])
        } else {
            heap_fds = (0..=self.links.len()).map(|_| PollFd::from_borrowed_fd(wake_fd, PollFlags::empty())).collect();
            heap_idx = vec![0; self.links.len() + 1];
            (&mut heap_fds[..], &mut heap_idx[..])
        };
        fds[0] = PollFd::from_borrowed_fd(wake_fd, PollFlags::IN);
        let mut n = 1;
        for (i, l) in self.links.iter().enumerate() {
            let want = l.interest.load(Ordering::SeqCst);
            if want == 0 {
                continue;
            }
            let mut events = PollFlags::empty();
            if want & WANT_READ != 0 {
                events |= PollFlags::IN;
            }
            if want & WANT_WRITE != 0 {
                events |= PollFlags::OUT;
            }
            let fd: BorrowedFd<'_> = l.sock.as_fd();
            fds[n] = PollFd::from_borrowed_fd(fd, events);
            idx[n] = i;
            n += 1;
        }
        let ts = Timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        match poll(&mut fds[..n], Some(&ts)) {
            Ok(0) | Err(Errno::INTR) => false,
            Err(_) => {
                // Not expected for valid descriptors; back off instead of spinning.
                std::thread::sleep(timeout.min(Duration::from_millis(1)));
                false
            }
            Ok(_) => {
                if !fds[0].revents().is_empty() {
                    let mut sink = [0u8; 64];
                    while matches!((&self.wake_rx).read(&mut sink), Ok(k) if k > 0) {}
                }
                for (fd, &i) in fds[1..n].iter().zip(&idx[1..n]) {
                    let r = fd.revents();
                    if r.is_empty() {
                        continue;
                    }
                    // One-shot: the link registers again if its next call cannot move.
                    let mut clear = 0;
                    if r.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR) {
                        clear |= WANT_READ;
                    }
                    if r.intersects(PollFlags::OUT | PollFlags::HUP | PollFlags::ERR) {
                        clear |= WANT_WRITE;
                    }
                    self.links[i].interest.fetch_and(!clear, Ordering::SeqCst);
                }
                self.epoch.fetch_add(1, Ordering::SeqCst);
                true
            }
        }
    }
}

impl Doorbell for TcpDoorbell {
    fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::SeqCst)
    }

    fn ctrl_count(&self) -> u32 {
        self.links.iter().fold(0u32, |sum, l| sum.wrapping_add(l.ctrl.load(Ordering::Acquire)))
    }

    fn wake(&self) {
        self.ring();
    }

    fn wait(&self, epoch: u32, until: Instant) {
        if self.epoch.load(Ordering::SeqCst) != epoch {
            return;
        }
        if !self.spin.is_zero() && (self.spin_loaded || self.load.has_core_per_task()) {
            // Polling while it pays: a wake-up from `poll(2)` costs more than a small message
            // takes to arrive. Yielding between polls gives the core to any task that wants it.
            let start = Instant::now();
            loop {
                if self.poll_once(Duration::ZERO) || self.epoch.load(Ordering::SeqCst) != epoch {
                    return;
                }
                let now = Instant::now();
                if now >= until || now.duration_since(start) >= self.spin {
                    break;
                }
                std::thread::yield_now();
            }
        }
        loop {
            if self.epoch.load(Ordering::SeqCst) != epoch {
                return;
            }
            let now = Instant::now();
            if now >= until {
                return;
            }
            if self.poll_once(until - now) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::runnable_tasks;

    #[test]
    fn reads_the_runnable_count_of_loadavg() {
        assert_eq!(runnable_tasks("0.52 0.58 0.59 3/467 1234\n"), Some(3));
        assert_eq!(runnable_tasks("0.00 0.01 0.05 17/2048 99"), Some(17));
        assert_eq!(runnable_tasks("0.52 0.58 0.59"), None);
        assert_eq!(runnable_tasks("0.52 0.58 0.59 x/467 1"), None);
    }
}
