//! One rank's shared-memory segment: creating, attaching, validating, unlinking and unmapping
//! it, and handing out its doorbell and ring ends.
//!
//! This file owns the memory layout and every raw pointer into a mapping. It does not decide
//! which peers attach or when names are unlinked (the endpoint does), nor the ring or doorbell
//! protocols (`ring.rs`, `futex.rs`).
//!
//! # Layout (version 6)
//!
//! | offset | what |
//! | --- | --- |
//! | 0 | [`Header`] (128 bytes): magic, version, world, owner rank and pid, layout sizes |
//! | 128 | the owner's doorbell ([`Bell`], three 128-byte lines: counter and sleepers; heartbeat and last op; count of control messages) |
//! | 512 | slot table: `world` × `u32`, the inbound ring slot of each rank or `u32::MAX` |
//! | `rings_offset` (page-aligned) | `slots` ring pairs, each a 384-byte control block + `ring_bytes` of data (the byte stream), then a 384-byte control block + [`CTRL_RING_BYTES`] (the control messages: `u32` length, then the message) |
//! | `workspace_offset` (page-aligned) | [`WORKSPACE_BYTES`] for the direct collectives |
//!
//! The creator writes everything, then stores `magic` last with `Release`; an attacher that
//! loads `magic` with `Acquire` and finds it set sees the rest. A zero `magic` means "still
//! being created" (retried); any other wrong value, or any field that disagrees with what the
//! attacher expects or with the layout recomputed from the header, rejects the segment with
//! [`ErrorKind::Protocol`] instead of misreading it.

use std::any::Any;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fd::OwnedFd;
use rustix::io::Errno;
use rustix::mm::{madvise, mmap, munmap, Advice, MapFlags, ProtFlags};
use rustix::shm;

use super::layout::{Bell, WORKSPACE_BYTES};
use super::ring::{Consumer, Producer, RingCtrl, CTRL_BYTES};
use crate::error::{Error, ErrorKind, Result};

/// "OXCOMSHM" little-endian.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"OXCOMSHM");
/// Bumped whenever the layout changes.
pub(crate) const VERSION: u32 = 6;
/// Bytes of each control ring (control messages of [`crate::transport::Link::send_ctrl`]).
pub(crate) const CTRL_RING_BYTES: usize = 16 << 10;
/// Smallest ring accepted (one page).
pub(crate) const MIN_RING_BYTES: usize = 4096;
/// Largest ring accepted.
pub(crate) const MAX_RING_BYTES: usize = 1 << 30;
/// Marks "no ring for this rank" in the slot table.
const NO_SLOT: u32 = u32::MAX;
const PAGE: usize = 4096;

/// The segment header. Every field is atomic because another process writes it; all but
/// `magic` are read `Relaxed` after `magic` was loaded with `Acquire`.
#[repr(C, align(128))]
#[cfg_attr(test, derive(Default))]
pub(crate) struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    header_bytes: AtomicU32,
    world: AtomicU64,
    owner_rank: AtomicU64,
    owner_pid: AtomicU64,
    ring_bytes: AtomicU64,
    slots: AtomicU64,
    table_offset: AtomicU64,
    rings_offset: AtomicU64,
    ring_stride: AtomicU64,
    total_bytes: AtomicU64,
}

const HEADER_BYTES: usize = std::mem::size_of::<Header>();

impl Header {
    /// Writes every field for a segment of `layout` owned by rank `owner_rank` (process
    /// `pid`), then `magic` last with `Release`: whoever loads it with `Acquire` sees the rest
    /// (and whatever the creator wrote into the segment before).
    fn publish(&self, layout: &Layout, owner_rank: usize, pid: u32) {
        self.version.store(VERSION, Ordering::Relaxed);
        self.header_bytes.store(HEADER_BYTES as u32, Ordering::Relaxed);
        self.world.store(layout.world as u64, Ordering::Relaxed);
        self.owner_rank.store(owner_rank as u64, Ordering::Relaxed);
        self.owner_pid.store(u64::from(pid), Ordering::Relaxed);
        self.ring_bytes.store(layout.ring_bytes as u64, Ordering::Relaxed);
        self.slots.store(layout.slots as u64, Ordering::Relaxed);
        self.table_offset.store(layout.table_offset as u64, Ordering::Relaxed);
        self.rings_offset.store(layout.rings_offset as u64, Ordering::Relaxed);
        self.ring_stride.store(layout.ring_stride as u64, Ordering::Relaxed);
        self.total_bytes.store(layout.total_bytes as u64, Ordering::Relaxed);
        self.magic.store(MAGIC, Ordering::Release);
    }

    /// Checks every field (after `magic`, which the caller checked) against what an attacher
    /// of rank `owner`'s segment in a world of `world` expects, and against the layout
    /// recomputed from the header and the file's `len`. The layout and owner pid, or why not.
    fn check(&self, owner: usize, world: usize, len: usize) -> std::result::Result<(Layout, u32), String> {
        let field = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let version = self.version.load(Ordering::Relaxed);
        if version != VERSION {
            return Err(format!("layout version {version}, expected {VERSION}"));
        }
        let hb = self.header_bytes.load(Ordering::Relaxed);
        if hb as usize != HEADER_BYTES {
            return Err(format!("header of {hb} bytes, expected {HEADER_BYTES}"));
        }
        let (w, r) = (field(&self.world), field(&self.owner_rank));
        if w != world as u64 {
            return Err(format!("world size {w}, expected {world}"));
        }
        if r != owner as u64 {
            return Err(format!("owner rank {r}, expected {owner}"));
        }
        let pid = field(&self.owner_pid);
        let (slots, ring_bytes) = (field(&self.slots), field(&self.ring_bytes));
        let layout = usize::try_from(slots)
            .ok()
            .zip(usize::try_from(ring_bytes).ok())
            .and_then(|(s, b)| Layout::new(world, s, b))
            .ok_or_else(|| format!("{slots} rings of {ring_bytes} bytes"))?;
        let stored =
            [field(&self.table_offset), field(&self.rings_offset), field(&self.ring_stride), field(&self.total_bytes)];
        let expected =
            [layout.table_offset, layout.rings_offset, layout.ring_stride, layout.total_bytes].map(|v| v as u64);
        if stored != expected {
            return Err(format!("layout (table, rings, stride, total) = {stored:?}, expected {expected:?}"));
        }
        if layout.total_bytes != len {
            return Err(format!("file is {len} bytes, header says {}", layout.total_bytes));
        }
        if pid == 0 || pid > i32::MAX as u64 {
            return Err(format!("owner pid {pid}"));
        }
        Ok((layout, pid as u32))
    }
}

const BELL_OFFSET: usize = HEADER_BYTES;
const TABLE_OFFSET: usize = BELL_OFFSET + std::mem::size_of::<Bell>();

/// Where things are in a segment; computed from (world, slots, ring_bytes) alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) world: usize,
    pub(crate) slots: usize,
    pub(crate) ring_bytes: usize,
    pub(crate) table_offset: usize,
    pub(crate) rings_offset: usize,
    pub(crate) ring_stride: usize,
    pub(crate) workspace_offset: usize,
    pub(crate) total_bytes: usize,
}

impl Layout {
    /// The layout for `slots` rings of `ring_bytes` in a world of `world`; `None` if a size
    /// overflows or `ring_bytes` is not an accepted power of two.
    pub(crate) fn new(world: usize, slots: usize, ring_bytes: usize) -> Option<Layout> {
        if !ring_bytes.is_power_of_two()
            || !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&ring_bytes)
            || slots > world
            || world > u32::MAX as usize / 2
        {
            return None;
        }
        let table_end = TABLE_OFFSET.checked_add(world.checked_mul(4)?)?;
        let rings_offset = table_end.checked_next_multiple_of(PAGE)?;
        let ring_stride = CTRL_BYTES.checked_add(ring_bytes)?.checked_add(CTRL_BYTES + CTRL_RING_BYTES)?;
        let rings_end = rings_offset.checked_add(ring_stride.checked_mul(slots)?)?;
        let workspace_offset = rings_end.checked_next_multiple_of(PAGE)?;
        let total_bytes = workspace_offset.checked_add(WORKSPACE_BYTES)?;
        // mmap lengths and file sizes must fit in isize / i64.
        if total_bytes > isize::MAX as usize {
            return None;
        }
        Some(Layout {
            world,
            slots,
            ring_bytes,
            table_offset: TABLE_OFFSET,
            rings_offset,
            ring_stride,
            workspace_offset,
            total_bytes,
        })
    }
}

/// A mapped segment (mine or a peer's). Unmapped on drop; an owned segment's name is also
/// unlinked on drop unless [`Segment::unlink`] already did.
pub(crate) struct Segment {
    base: NonNull<u8>,
    len: usize,
    layout: Layout,
    name: String,
    owner_pid: u32,
    own: bool,
    unlinked: AtomicBool,
    /// How many peer processes the death watcher (`watch.rs`) has seen exit while this
    /// process waits on this segment's bell (its owner's only; process-local, not in the
    /// mapping). Bumped before the watcher rings the bell.
    deaths: AtomicU32,
}

// SAFETY: the mapping is process-shared memory that lives until `Drop`; every access to it
// goes through atomics (header, bell, table, ring counters) or the SPSC ring protocol.
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` hands out only atomics and ring ends whose exclusivity the
// endpoint guarantees.
unsafe impl Sync for Segment {}

fn io_err(what: impl std::fmt::Display, e: Errno) -> Error {
    Error::io(what, e.into())
}

/// Maps `len` bytes of `fd` shared and read-write.
fn map(fd: &OwnedFd, len: usize, name: &str) -> Result<NonNull<u8>> {
    // SAFETY: a fresh mapping chosen by the kernel (null hint), of a file we hold open; it
    // aliases no Rust object. Accesses beyond the file's size would fault, so callers map only
    // sizes the file has (ftruncate'd by us, or fstat'ed).
    let ptr = unsafe { mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, 0) }
        .map_err(|e| io_err(format_args!("mapping shared-memory segment {name}"), e))?;
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| Error::new(ErrorKind::Io, "mmap returned null"))
}

/// Unmaps a mapping made by [`map`].
///
/// # Safety
/// `base`/`len` must be a live mapping from [`map`] that nothing references any more.
unsafe fn unmap(base: NonNull<u8>, len: usize) {
    // SAFETY: forwarded from this function's contract.
    let _ = unsafe { munmap(base.as_ptr().cast::<c_void>(), len) };
}

/// `/dev/shm` path of a POSIX shm name, for messages.
fn path_of(name: &str) -> String {
    format!("/dev/shm{name}")
}

impl Segment {
    /// Creates, sizes, maps and initialises a new segment named `name` (`O_EXCL`: an existing
    /// one is an error). `ring_of[p]` is the inbound ring slot of rank `p`.
    pub(crate) fn create(name: &str, owner_rank: usize, layout: Layout, ring_of: &[Option<usize>]) -> Result<Segment> {
        let fd = shm::open(
            name,
            shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR,
            shm::Mode::RUSR | shm::Mode::WUSR,
        )
        .map_err(|e| match e {
            Errno::EXIST => Error::new(
                ErrorKind::Io,
                format!(
                    "shared-memory segment {} already exists: a stale segment from an earlier \
                     run with the same job name, or another job using it; remove the file or \
                     choose another job name",
                    path_of(name)
                ),
            ),
            e => io_err(format_args!("creating shared-memory segment {}", path_of(name)), e),
        })?;
        // From here on the name exists: remove it if anything below fails.
        let unlink_on_err = |err: Error| {
            let _ = shm::unlink(name);
            err
        };
        let total = layout.total_bytes as u64;
        rustix::fs::ftruncate(&fd, total)
            .map_err(|e| unlink_on_err(io_err(format_args!("sizing {}", path_of(name)), e)))?;
        // Reserve the pages now so a full /dev/shm fails here, not as SIGBUS on first touch.
        match rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, total) {
            Ok(()) | Err(Errno::OPNOTSUPP) | Err(Errno::NOSYS) => {}
            Err(e) => {
                return Err(unlink_on_err(io_err(
                    format_args!("reserving {total} bytes for {} (is /dev/shm large enough?)", path_of(name)),
                    e,
                )))
            }
        }
        let base = map(&fd, layout.total_bytes, name).map_err(unlink_on_err)?;
        let seg = Segment {
            base,
            len: layout.total_bytes,
            layout,
            name: name.to_string(),
            owner_pid: rustix::process::getpid().as_raw_nonzero().get() as u32,
            own: true,
            unlinked: AtomicBool::new(false),
            deaths: AtomicU32::new(0),
        };
        for (p, slot) in ring_of.iter().enumerate().take(layout.world) {
            let v = slot.map_or(NO_SLOT, |s| s as u32);
            seg.table_entry(p).store(v, Ordering::Relaxed);
        }
        seg.populate_workspace(true);
        // Bell and ring control blocks are zero (fresh file), their valid initial state.
        seg.header().publish(&layout, owner_rank, seg.owner_pid);
        Ok(seg)
    }

    /// Opens and maps the segment `name` of rank `owner` and validates its header against
    /// `world`. Retries while it does not exist yet or is still being created, until
    /// `deadline`; `watch` runs between retries, at most every `watch_every`, and its error
    /// ends the wait.
    pub(crate) fn attach(
        name: &str,
        owner: usize,
        world: usize,
        deadline: Instant,
        watch: &dyn Fn() -> Result<()>,
        watch_every: Duration,
    ) -> Result<Segment> {
        let mut pause = Duration::from_micros(200);
        let mut watched = Instant::now();
        loop {
            let why_not = match Self::try_attach(name, owner, world)? {
                Ok(seg) => return Ok(seg),
                Err(why) => why,
            };
            let now = Instant::now();
            if now >= watched + watch_every {
                watched = now;
                watch()?;
            }
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("timed out attaching to rank {owner}'s shared-memory segment {}: {why_not}", path_of(name)),
                )
                .with_peer(owner));
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    /// One attach attempt: `Ok(Err(reason))` means "not there yet, retry".
    fn try_attach(name: &str, owner: usize, world: usize) -> Result<std::result::Result<Segment, &'static str>> {
        let fd = match shm::open(name, shm::OFlags::RDWR, shm::Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(Err("it does not exist yet")),
            Err(e) => return Err(io_err(format_args!("opening {}", path_of(name)), e)),
        };
        let size = rustix::fs::fstat(&fd).map_err(|e| io_err(format_args!("stat of {}", path_of(name)), e))?.st_size;
        let len = usize::try_from(size).unwrap_or(0);
        if len < TABLE_OFFSET {
            return Ok(Err("it is still being sized"));
        }
        let base = map(&fd, len, name)?;
        let mut seg = Segment {
            base,
            len,
            // Placeholder until validated; only the header is read before then.
            layout: Layout {
                world: 0,
                slots: 0,
                ring_bytes: 0,
                table_offset: TABLE_OFFSET,
                rings_offset: len,
                ring_stride: 0,
                workspace_offset: len,
                total_bytes: len,
            },
            name: name.to_string(),
            owner_pid: 0,
            own: false,
            unlinked: AtomicBool::new(true),
            deaths: AtomicU32::new(0),
        };
        match seg.header().magic.load(Ordering::Acquire) {
            0 => return Ok(Err("its header is not initialised yet")),
            MAGIC => {}
            other => return Err(seg.reject(format!("bad magic {other:#018x} (expected {MAGIC:#018x})"))),
        }
        seg.validate(owner, world)?;
        seg.populate_workspace(false);
        Ok(Ok(seg))
    }

    /// Maps the workspace's pages now (the owner writable, a peer, which only reads it,
    /// readable), so that no direct op pays a page fault on its first touch of a page. Those
    /// faults made the first copy-ins into each place of a chunk half slow enough for the
    /// far-cores watch (`algorithms/shm_direct/copy_in.rs`) to take near cores for far ones.
    /// Best effort: kernels before 5.14 lack the advice, and the pages then fault in on use.
    fn populate_workspace(&self, owner: bool) {
        let advice = if owner { Advice::LinuxPopulateWrite } else { Advice::LinuxPopulateRead };
        // SAFETY: the workspace range lies inside this live mapping (`workspace`); populating
        // page tables changes no byte of it.
        let _ = unsafe { madvise(self.workspace().as_ptr().cast::<c_void>(), WORKSPACE_BYTES, advice) };
    }

    fn reject(&self, what: String) -> Error {
        Error::new(
            ErrorKind::Protocol,
            format!("shared-memory segment {} is stale or foreign: {what}", path_of(&self.name)),
        )
    }

    /// Checks every header field and the slot table; on success fills in `layout` and
    /// `owner_pid`.
    fn validate(&mut self, owner: usize, world: usize) -> Result<()> {
        let (layout, pid) = self.header().check(owner, world, self.len).map_err(|why| self.reject(why))?;
        self.layout = layout;
        self.owner_pid = pid;
        for p in 0..world {
            let v = self.table_entry(p).load(Ordering::Relaxed);
            if v != NO_SLOT && v as usize >= layout.slots {
                return Err(self.reject(format!("ring slot {v} for rank {p} out of range")));
            }
        }
        Ok(())
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least `TABLE_OFFSET > HEADER_BYTES` long (checked before
        // mapping), page-aligned (so 128-aligned) and lives as long as `self`; `Header` is all
        // atomics, valid for any bit pattern and shared access.
        unsafe { self.base.cast::<Header>().as_ref() }
    }

    /// The owner's doorbell.
    pub(crate) fn bell(&self) -> &Bell {
        // SAFETY: `BELL_OFFSET + size_of::<Bell>() == TABLE_OFFSET <= len`, 128-aligned; `Bell`
        // is all atomics.
        unsafe { self.base.add(BELL_OFFSET).cast::<Bell>().as_ref() }
    }

    fn table_entry(&self, rank: usize) -> &AtomicU32 {
        assert!(rank < self.layout.world, "slot table index out of range");
        // SAFETY: `rank < world`, and the table of `world` u32s ends before `rings_offset <=
        // len` (checked by `validate`, or by construction in `create`); 4-aligned.
        unsafe { self.base.add(self.layout.table_offset + 4 * rank).cast::<AtomicU32>().as_ref() }
    }

    /// The inbound ring slot of `rank` in this segment, if it has one.
    pub(crate) fn slot_of(&self, rank: usize) -> Option<usize> {
        if rank >= self.layout.world {
            return None;
        }
        let v = self.table_entry(rank).load(Ordering::Relaxed);
        (v != NO_SLOT && (v as usize) < self.layout.slots).then_some(v as usize)
    }

    /// Pointers to ring `slot`'s control block and data area.
    fn ring_ptrs(&self, slot: usize) -> (NonNull<RingCtrl>, NonNull<u8>) {
        assert!(slot < self.layout.slots, "ring slot out of range");
        let off = self.layout.rings_offset + slot * self.layout.ring_stride;
        // SAFETY: `slot < slots`, so `off + ring_stride <= total_bytes == len`; `off` is
        // 128-aligned (`rings_offset` is page-aligned, `ring_stride` a multiple of 128).
        unsafe {
            let ctrl = self.base.add(off);
            (ctrl.cast::<RingCtrl>(), ctrl.add(CTRL_BYTES))
        }
    }

    /// Pointers to the control ring of slot `slot` (after its byte ring).
    fn ctrl_ring_ptrs(&self, slot: usize) -> (NonNull<RingCtrl>, NonNull<u8>) {
        let (ctrl, _) = self.ring_ptrs(slot);
        // SAFETY: the control ring is the last `CTRL_BYTES + CTRL_RING_BYTES` of the slot's
        // stride (`Layout::new`), inside the mapping; `ring_bytes` and `CTRL_BYTES` are
        // multiples of 128, so it is 128-aligned.
        unsafe {
            let c = ctrl.cast::<u8>().add(CTRL_BYTES + self.layout.ring_bytes);
            (c.cast::<RingCtrl>(), c.add(CTRL_BYTES))
        }
    }

    /// The writing end of slot `slot`'s control ring. One per ring (the caller).
    pub(crate) fn ctrl_producer(self: &Arc<Self>, slot: usize) -> Producer {
        let (ctrl, data) = self.ctrl_ring_ptrs(slot);
        let owner: Arc<dyn Any + Send + Sync> = self.clone();
        // SAFETY: as in `producer`, for the control ring (`CTRL_RING_BYTES`, a power of two).
        unsafe { Producer::new(owner, ctrl, data, CTRL_RING_BYTES) }
    }

    /// The reading end of slot `slot`'s control ring. One per ring (the caller).
    pub(crate) fn ctrl_consumer(self: &Arc<Self>, slot: usize) -> Consumer {
        let (ctrl, data) = self.ctrl_ring_ptrs(slot);
        let owner: Arc<dyn Any + Send + Sync> = self.clone();
        // SAFETY: as in `consumer`, for the control ring.
        unsafe { Consumer::new(owner, ctrl, data, CTRL_RING_BYTES) }
    }

    /// The control block of ring `slot` (for its flags).
    pub(crate) fn ring_ctrl(&self, slot: usize) -> &RingCtrl {
        let (ctrl, _) = self.ring_ptrs(slot);
        // SAFETY: `ring_ptrs` points inside this mapping, 128-aligned; `RingCtrl` is all
        // atomics, valid for any bit pattern and shared access; it lives as long as `self`.
        unsafe { ctrl.as_ref() }
    }

    /// The writing end of ring `slot`. The caller guarantees it makes only one per ring.
    pub(crate) fn producer(self: &Arc<Self>, slot: usize) -> Producer {
        let (ctrl, data) = self.ring_ptrs(slot);
        let owner: Arc<dyn Any + Send + Sync> = self.clone();
        // SAFETY: both pointers lie in this mapping, kept alive by `owner`; the ring memory is
        // a valid `RingCtrl` (zeroed at creation, then only touched by ring ends); `ring_bytes`
        // is a power of two (validated); one producer per ring (caller).
        unsafe { Producer::new(owner, ctrl, data, self.layout.ring_bytes) }
    }

    /// The reading end of ring `slot`. The caller guarantees it makes only one per ring.
    pub(crate) fn consumer(self: &Arc<Self>, slot: usize) -> Consumer {
        let (ctrl, data) = self.ring_ptrs(slot);
        let owner: Arc<dyn Any + Send + Sync> = self.clone();
        // SAFETY: as in `producer`, with one consumer per ring.
        unsafe { Consumer::new(owner, ctrl, data, self.layout.ring_bytes) }
    }

    /// The direct-collectives workspace: [`WORKSPACE_BYTES`] bytes, page-aligned,
    /// inside this mapping and alive as long as `self`.
    pub(crate) fn workspace(&self) -> NonNull<u8> {
        // SAFETY: `workspace_offset + WORKSPACE_BYTES == total_bytes == len` (by `Layout::new`,
        // checked against the file size by `validate`), so the pointer is inside the mapping.
        unsafe { self.base.add(self.layout.workspace_offset) }
    }

    /// The pid that created the segment.
    /// The count of peer deaths the watcher has announced on this segment's bell (see the
    /// `deaths` field).
    pub(crate) fn deaths(&self) -> &AtomicU32 {
        &self.deaths
    }

    pub(crate) fn owner_pid(&self) -> u32 {
        self.owner_pid
    }

    /// The POSIX shm name (`/oxcomm-…`).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Removes the segment's name (only for the segment we created; once). The mapping stays.
    pub(crate) fn unlink(&self) -> Result<()> {
        if !self.own || self.unlinked.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        match shm::unlink(self.name.as_str()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(io_err(format_args!("unlinking {}", path_of(&self.name)), e)),
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        let _ = self.unlink();
        // SAFETY: the mapping was made by `map` with this length; `&mut self` means no
        // reference into it remains (ring ends hold an `Arc<Segment>`, so they are gone).
        unsafe { unmap(self.base, self.len) };
    }
}

/// Layout and header checks on heap memory (no mapping, no syscall), so they also run under
/// Miri (bench/miri.sh).
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_places_everything_aligned_and_in_order() {
        let l = Layout::new(8, 3, MIN_RING_BYTES).expect("layout");
        assert_eq!(l.table_offset, TABLE_OFFSET);
        assert!(l.table_offset + 4 * 8 <= l.rings_offset);
        assert_eq!(l.rings_offset % PAGE, 0);
        assert_eq!(l.ring_stride, 2 * CTRL_BYTES + MIN_RING_BYTES + CTRL_RING_BYTES);
        assert_eq!(l.ring_stride % 128, 0);
        assert!(l.rings_offset + 3 * l.ring_stride <= l.workspace_offset);
        assert_eq!(l.workspace_offset % PAGE, 0);
        assert_eq!(l.total_bytes, l.workspace_offset + WORKSPACE_BYTES);
        assert_eq!(HEADER_BYTES, 128);
        assert_eq!(BELL_OFFSET % 128, 0);
    }

    #[test]
    fn layout_rejects_bad_sizes() {
        assert!(Layout::new(4, 1, 5000).is_none(), "not a power of two");
        assert!(Layout::new(4, 1, MIN_RING_BYTES / 2).is_none());
        assert!(Layout::new(4, 1, MAX_RING_BYTES * 2).is_none());
        assert!(Layout::new(2, 3, MIN_RING_BYTES).is_none(), "more rings than ranks");
        assert!(Layout::new(usize::MAX / 2, 1, MIN_RING_BYTES).is_none(), "world too large");
    }

    #[test]
    fn a_published_header_checks_out() {
        let layout = Layout::new(4, 3, MIN_RING_BYTES).expect("layout");
        let h = Box::new(Header::default());
        h.publish(&layout, 2, 4242);
        assert_eq!(h.magic.load(Ordering::Acquire), MAGIC);
        assert_eq!(h.check(2, 4, layout.total_bytes), Ok((layout, 4242)));
    }

    #[test]
    fn every_wrong_field_is_rejected() {
        let layout = Layout::new(4, 3, MIN_RING_BYTES).expect("layout");
        let fresh = || {
            let h = Box::new(Header::default());
            h.publish(&layout, 2, 4242);
            h
        };
        let total = layout.total_bytes;
        // What the attacher expects.
        assert!(fresh().check(1, 4, total).unwrap_err().contains("owner rank"));
        assert!(fresh().check(2, 5, total).unwrap_err().contains("world size"));
        assert!(fresh().check(2, 4, total + PAGE).unwrap_err().contains("file is"));
        // Each field, tampered with.
        type Tamper = (&'static str, fn(&Header));
        let tamper: [Tamper; 8] = [
            ("version", |h| h.version.store(VERSION + 1, Ordering::Relaxed)),
            ("header of", |h| h.header_bytes.store(64, Ordering::Relaxed)),
            ("rings of", |h| h.ring_bytes.store(5000, Ordering::Relaxed)),
            ("rings of", |h| h.slots.store(9, Ordering::Relaxed)),
            ("layout", |h| h.rings_offset.store(0, Ordering::Relaxed)),
            ("layout", |h| h.ring_stride.store(1, Ordering::Relaxed)),
            ("owner pid", |h| h.owner_pid.store(0, Ordering::Relaxed)),
            ("owner pid", |h| h.owner_pid.store(u64::MAX, Ordering::Relaxed)),
        ];
        for (what, f) in tamper {
            let h = fresh();
            f(&h);
            let why = h.check(2, 4, total).unwrap_err();
            assert!(why.contains(what), "{what}: {why}");
        }
    }
}
