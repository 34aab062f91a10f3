//! The MPI backend's ops: each maps onto MPI calls on the group's MPI communicator (see the
//! table in the [module docs](super)), after the fingerprint check ([`MpiBackend::prepare`]).

use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

use mpi::ffi;

use super::*;
use crate::algorithms::Algorithm;
use crate::backend::{concat, split_back, unpack_gathered, Backend, NewGroup, OpEnv, P2pMsg, Route};
use crate::buffers::{ExchangeBuffers, GatherBuffers, ReduceBuffers, ScatterBuffers};
use crate::wire::OpKind;

impl Backend for MpiBackend {
    fn transport(&self) -> crate::transport::Transport {
        crate::transport::Transport::Mpi
    }

    /// MPI picks its own algorithms and segments: the algorithm settings are ignored.
    fn route(
        &self,
        _kind: OpKind,
        _bytes: usize,
        _count: usize,
        _group: &GroupView<'_>,
        _forced: Option<Algorithm>,
    ) -> Result<Route> {
        Ok(Route { algorithm: None, name: "mpi", agree: false })
    }

    /// With ULFM, `MPIX_Comm_revoke` of every communicator of this backend, so that every
    /// member's pending and later MPI calls on them fail; without it nothing (the
    /// communicator's own abort rule still fails this rank's later ops).
    fn revoke(&self, _cause: &Error) {
        self.ulfm_revoke();
    }

    fn agree(&self, env: &mut OpEnv<'_>, flag: u64) -> Result<(u64, Vec<usize>)> {
        self.ulfm_agree(env.group.members, flag)
    }

    fn shrink(&self, _env: &mut OpEnv<'_>) -> Result<crate::backend::Shrunk> {
        let (rank, survivors, backend) = self.ulfm_shrink()?;
        Ok(crate::backend::Shrunk { backend: crate::backend::AnyBackend::Mpi(backend), rank, survivors })
    }

    fn known_failed(&self) -> Vec<usize> {
        self.ulfm_failed()
    }

    fn fault_tolerance(&self) -> Result<()> {
        self.ulfm("fault tolerance (revoke, agree, shrink)").map(|_| ())
    }

    fn group_needs_op(&self) -> bool {
        true
    }

    fn members_groups(&self) -> Result<()> {
        Err(Error::unsupported("members_group on the MPI backend (use new_group or split)"))
    }

    fn all_reduce<'b, T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        _route: Route,
        io: ReduceBuffers<'b, T>,
        op: ReduceOp,
    ) -> Result<&'b mut [T]> {
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            let buf = io.into_in_place();
            self.all_reduce_in(&g, c, buf, op, stats)?;
            Ok(buf)
        }
    }

    fn reduce<'b, T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        _route: Route,
        mut io: ReduceBuffers<'b, T>,
        root: usize,
        op: ReduceOp,
    ) -> Result<&'b mut [T]> {
        let (n, me) = (env.group.size(), env.group.rank);
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            let total = io.len();
            let (mop, len, bytes) = (self.op::<T>(op)?, count(total)?, total * std::mem::size_of::<T>());
            let (send, recv): (*const c_void, *mut c_void) = match &mut io {
                ReduceBuffers::InPlace(buf) if me == root => (in_place(), rp(buf)),
                ReduceBuffers::InPlace(buf) => (sp(buf), std::ptr::null_mut()),
                ReduceBuffers::Apart { input, output } if me == root => (sp(input), rp(output)),
                ReduceBuffers::Apart { input, .. } => (sp(input), std::ptr::null_mut()),
            };
            // SAFETY: at the root in place on its buffer, or from its input (only read) into
            // its distinct output of the same length; elsewhere the input is only read and the
            // receive buffer is ignored. `len` elements of T's datatype.
            mpi_call("MPI_Reduce", unsafe {
                ffi::MPI_Reduce(send, recv, len, datatype(T::DTYPE), mop, root as c_int, c)
            })?;
            if me == root {
                add(stats, 0, (n - 1) * bytes);
            } else {
                add(stats, bytes, 0);
            }
            Ok(io.into_output())
        }
    }

    fn broadcast<T: Element>(&self, env: &mut OpEnv<'_>, _route: Route, buf: &mut [T], root: usize) -> Result<()> {
        let (n, me) = (env.group.size(), env.group.rank);
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            let (len, bytes) = (count(buf.len())?, std::mem::size_of_val(buf));
            // SAFETY: `buf` holds `len` elements of T's datatype.
            mpi_call("MPI_Bcast", unsafe { ffi::MPI_Bcast(rp(buf), len, datatype(T::DTYPE), root as c_int, c) })?;
            if me == root {
                add(stats, (n - 1) * bytes, 0);
            } else {
                add(stats, 0, bytes);
            }
            Ok(())
        }
    }

    fn all_gather<T: Element>(&self, env: &mut OpEnv<'_>, _route: Route, io: GatherBuffers<'_, T>) -> Result<()> {
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            match io {
                GatherBuffers::Apart { input, output } => all_gather_in(&g, c, input, output, stats),
                GatherBuffers::InPlace(buf) => {
                    let m = buf.len() / g.size();
                    let (len, dt) = (count(m)?, datatype(T::DTYPE));
                    count(buf.len())?;
                    // SAFETY: `buf` holds n × `len` elements of T's datatype; with MPI_IN_PLACE
                    // this rank's block of it is the contribution (the send arguments are
                    // ignored).
                    mpi_call("MPI_Allgather", unsafe { ffi::MPI_Allgather(in_place(), len, dt, rp(buf), len, dt, c) })?;
                    let share = (g.size() - 1) * m * std::mem::size_of::<T>();
                    add(stats, share, share);
                    Ok(())
                }
            }
        }
    }

    fn reduce_scatter<'b, T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        _route: Route,
        io: ScatterBuffers<'b, T>,
        op: ReduceOp,
    ) -> Result<&'b mut [T]> {
        let (n, me) = (env.group.size(), env.group.rank);
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            let m = io.block_len(n);
            let (mop, len, dt) = (self.op::<T>(op)?, count(m)?, datatype(T::DTYPE));
            count(n * m)?;
            let share = ring_share(n * m * std::mem::size_of::<T>(), n);
            let out = match io {
                ScatterBuffers::Apart { input, output } => {
                    // SAFETY: `input` holds n × `len` elements, `output` `len`, of T's
                    // datatype; the two are distinct.
                    mpi_call("MPI_Reduce_scatter_block", unsafe {
                        ffi::MPI_Reduce_scatter_block(sp(input), rp(output), len, dt, mop, c)
                    })?;
                    output
                }
                ScatterBuffers::InPlace(buf) => {
                    // SAFETY: `buf` holds n × `len` elements of T's datatype; with MPI_IN_PLACE
                    // MPI reads them all and writes the result to the first `len`.
                    mpi_call("MPI_Reduce_scatter_block", unsafe {
                        ffi::MPI_Reduce_scatter_block(in_place(), rp(buf), len, dt, mop, c)
                    })?;
                    // MPI puts the result first; NCCL's in-place form (ours) at this rank's block.
                    buf.copy_within(0..m, me * m);
                    &mut buf[me * m..(me + 1) * m]
                }
            };
            add(stats, share, share);
            Ok(out)
        }
    }

    fn all_to_all<T: Element>(&self, env: &mut OpEnv<'_>, _route: Route, io: ExchangeBuffers<'_, T>) -> Result<()> {
        let n = env.group.size();
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            let total = io.send_len();
            let block = count(total / n)?;
            count(total)?;
            let dt = datatype(T::DTYPE);
            let (send, recv) = match io {
                ExchangeBuffers::Apart { send, recv } => (sp(send), rp(recv)),
                ExchangeBuffers::InPlace(buf) => (in_place().cast_const(), rp(buf)),
            };
            // SAFETY: `recv` holds n blocks of `block` elements of T's datatype; `send` too
            // and distinct from it, or MPI_IN_PLACE (then each block of `recv` is replaced by
            // the one from its rank).
            mpi_call("MPI_Alltoall", unsafe { ffi::MPI_Alltoall(send, block, dt, recv, block, dt, c) })?;
            let share = ring_share(total * std::mem::size_of::<T>(), n);
            add(stats, share, share);
            Ok(())
        }
    }

    /// Ranks first exchange their send counts (`MPI_Alltoall`) and agree (`MPI_Allreduce`)
    /// on whether any receiver expects a different count, so a disagreement fails on every
    /// rank, naming the peer, before any payload moves.
    fn all_to_all_v<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        _route: Route,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (n, me) = (env.group.size(), env.group.rank);
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            count(send.len())?;
            count(recv.len())?;
            let mine: Vec<u64> = send_counts.iter().map(|&x| x as u64).collect();
            let mut theirs = vec![0u64; n];
            // SAFETY: one u64 to and from each rank; buffers of n u64, distinct.
            mpi_call("MPI_Alltoall (counts)", unsafe {
                ffi::MPI_Alltoall(mine.as_ptr().cast(), 1, u64_type(), theirs.as_mut_ptr().cast(), 1, u64_type(), c)
            })?;
            let bad = (0..n).find(|&p| theirs[p] != recv_counts[p] as u64);
            let flag = [bad.map_or(0u64, |_| me as u64 + 1)];
            let mut worst = [0u64];
            // SAFETY: one u64 in, one out.
            mpi_call("MPI_Allreduce (counts)", unsafe {
                ffi::MPI_Allreduce(flag.as_ptr().cast(), worst.as_mut_ptr().cast(), 1, u64_type(), ffi::RSMPI_MAX, c)
            })?;
            if let Some(p) = bad {
                let who = g.members[p];
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!(
                        "rank {who} sends {} elements to this rank but recv_counts[{p}] = {}",
                        theirs[p], recv_counts[p]
                    ),
                )
                .with_peer(who));
            }
            if worst[0] > 0 {
                let who = g.members[worst[0] as usize - 1];
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    format!("rank {who} found that a peer's send count differs from its recv count (see its error)"),
                )
                .with_peer(who));
            }
            let layout = |counts: &[usize]| -> (Vec<c_int>, Vec<c_int>) {
                let mut at = 0;
                counts
                    .iter()
                    .map(|&k| {
                        at += k;
                        (k as c_int, (at - k) as c_int)
                    })
                    .unzip()
            };
            let ((sc, sd), (rc, rd)) = (layout(send_counts), layout(recv_counts));
            let dt = datatype(T::DTYPE);
            // SAFETY: counts and displacements describe `send` and `recv` exactly (their
            // totals equal the lengths, checked by the caller, and fit a C int).
            mpi_call("MPI_Alltoallv", unsafe {
                ffi::MPI_Alltoallv(sp(send), sc.as_ptr(), sd.as_ptr(), dt, rp(recv), rc.as_ptr(), rd.as_ptr(), dt, c)
            })?;
            let size = std::mem::size_of::<T>();
            let others =
                |counts: &[usize]| counts.iter().enumerate().filter(|(p, _)| *p != me).map(|(_, k)| k).sum::<usize>();
            add(stats, others(send_counts) * size, others(recv_counts) * size);
            Ok(())
        }
    }

    fn gather<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        _route: Route,
        io: GatherBuffers<'_, T>,
        root: usize,
    ) -> Result<()> {
        let (n, me) = (env.group.size(), env.group.rank);
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            let m = io.block_len(n);
            let (len, dt, bytes) = (count(m)?, datatype(T::DTYPE), m * std::mem::size_of::<T>());
            count(n * m)?;
            let (root_c, call) = (root as c_int, "MPI_Gather");
            match io {
                GatherBuffers::Apart { input, .. } if me != root => {
                    add(stats, bytes, 0);
                    // SAFETY: `input` holds `len` elements; a non-root's receive buffer is
                    // ignored.
                    mpi_call(call, unsafe {
                        ffi::MPI_Gather(sp(input), len, dt, std::ptr::null_mut(), len, dt, root_c, c)
                    })
                }
                GatherBuffers::Apart { input, output } => {
                    add(stats, 0, (n - 1) * bytes);
                    // SAFETY: `input` holds `len` elements; `output` n × `len` (checked by the
                    // caller) and is distinct.
                    mpi_call(call, unsafe { ffi::MPI_Gather(sp(input), len, dt, rp(output), len, dt, root_c, c) })
                }
                GatherBuffers::InPlace(buf) => {
                    add(stats, 0, (n - 1) * bytes);
                    // SAFETY: the root's `buf` holds n × `len` elements; with MPI_IN_PLACE its
                    // own block is already there and the send arguments are ignored.
                    mpi_call(call, unsafe { ffi::MPI_Gather(in_place(), len, dt, rp(buf), len, dt, root_c, c) })
                }
            }
        }
    }

    fn scatter<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        _route: Route,
        io: ScatterBuffers<'_, T>,
        root: usize,
    ) -> Result<()> {
        let (n, me) = (env.group.size(), env.group.rank);
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            let m = io.block_len(n);
            let (len, dt, bytes) = (count(m)?, datatype(T::DTYPE), m * std::mem::size_of::<T>());
            count(n * m)?;
            let (root_c, call) = (root as c_int, "MPI_Scatter");
            match io {
                ScatterBuffers::Apart { output, .. } if me != root => {
                    add(stats, 0, bytes);
                    // SAFETY: `output` holds `len` elements; a non-root's send buffer is ignored.
                    mpi_call(call, unsafe {
                        ffi::MPI_Scatter(std::ptr::null(), len, dt, rp(output), len, dt, root_c, c)
                    })
                }
                ScatterBuffers::Apart { input, output } => {
                    add(stats, (n - 1) * bytes, 0);
                    // SAFETY: `input` holds n × `len` elements (checked by the caller) and is
                    // distinct from `output`, which holds `len`.
                    mpi_call(call, unsafe { ffi::MPI_Scatter(sp(input), len, dt, rp(output), len, dt, root_c, c) })
                }
                ScatterBuffers::InPlace(buf) => {
                    add(stats, (n - 1) * bytes, 0);
                    // SAFETY: the root's `buf` holds n × `len` elements; with MPI_IN_PLACE its
                    // own block stays there and the receive arguments are ignored.
                    mpi_call(call, unsafe { ffi::MPI_Scatter(sp(buf), len, dt, in_place(), len, dt, root_c, c) })
                }
            }
        }
    }

    fn barrier(&self, env: &mut OpEnv<'_>, _route: Route) -> Result<()> {
        {
            let (fp, g) = (env.fp, env.group);
            let c = self.prepare(&g, fp)?;
            // SAFETY: `c` is the group's communicator.
            mpi_call("MPI_Barrier", unsafe { ffi::MPI_Barrier(c) })
        }
    }

    /// A barrier with a deadline: a non-blocking allreduce of the fingerprint hash (which is
    /// the fingerprint check too), polled until `timeout`. MPI cannot say who is missing.
    fn monitored_barrier(&self, env: &mut OpEnv<'_>, _route: Route, timeout: Duration) -> Result<()> {
        {
            let (fp, g) = (env.fp, env.group);
            let deadline = Instant::now() + timeout;
            let c = self.comm_of(&g)?.0;
            let h = fnv1a(&fp.encode());
            // On the heap, and leaked if the deadline passes: MPI may still write them later.
            let mut bufs = Box::new(([h, !h], [0u64; 2]));
            // SAFETY: a null request is a valid place for MPI to write the new one.
            let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: two u64 in and out, in a heap block that outlives the request (it is
            // leaked when the request is abandoned).
            mpi_call("MPI_Iallreduce (monitored barrier)", unsafe {
                ffi::MPI_Iallreduce(
                    bufs.0.as_ptr().cast(),
                    bufs.1.as_mut_ptr().cast(),
                    2,
                    u64_type(),
                    ffi::RSMPI_MAX,
                    c,
                    &mut req,
                )
            })?;
            match wait_until(&mut req, deadline, "MPI_Test (monitored barrier)") {
                Ok(true) => {}
                Ok(false) => {
                    std::mem::forget(bufs);
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "timed out after {timeout:?}: not every rank of the group reached the barrier \
                             (MPI cannot tell which)"
                        ),
                    ));
                }
                Err(e) => {
                    std::mem::forget(bufs);
                    return Err(e);
                }
            }
            let got = bufs.1;
            if self.check && (got[0] != h || !got[1] != h) {
                return Err(self.mismatch(&g, c, fp));
            }
            Ok(())
        }
    }

    fn all_reduce_coalesced<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        _route: Route,
        bufs: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            let mut flat = concat(bufs.iter().map(|b| &**b));
            self.all_reduce_in(&g, c, &mut flat, op, stats)?;
            split_back(&flat, bufs);
            Ok(())
        }
    }

    fn all_gather_coalesced<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        _route: Route,
        inputs: &[&[T]],
        outputs: &mut [&mut [T]],
    ) -> Result<()> {
        let n = env.group.size();
        {
            let (fp, g, stats) = (env.fp, env.group, &mut *env.stats);
            let c = self.prepare(&g, fp)?;
            let flat = concat(inputs.iter().copied());
            let mut all = vec![T::default(); flat.len() * n];
            all_gather_in(&g, c, &flat, &mut all, stats)?;
            unpack_gathered(&all, inputs, outputs, n);
            Ok(())
        }
    }

    /// `MPI_Comm_split` of the parent's communicator with the color and key the communicator
    /// computed (members of one new group share a color; keys are their new ranks), the new
    /// communicator recorded under the new group's id.
    fn new_group(&self, env: &mut OpEnv<'_>, _route: Route, new: NewGroup) -> Result<()> {
        let (fp, g) = (env.fp, env.group);
        let c = self.prepare(&g, fp)?;
        if let Some(made) = split_comm(c, new.color, new.key)? {
            self.comms.lock().unwrap_or_else(|e| e.into_inner()).insert(new.id, made);
        }
        Ok(())
    }

    /// Runs a batch of sends and receives (world ranks) on the point-to-point communicator:
    /// every header both ways at once, a check of the received ones, then every payload.
    fn p2p(&self, env: &mut OpEnv<'_>, jobs: &mut [P2pMsg]) -> Result<()> {
        if let [job] = jobs {
            if job.is_any_source() {
                return self.recv_any(env, job);
            }
        }
        let (c, stats) = (self.p2p.0, &mut *env.stats);
        // Headers live on the heap, and are leaked (with the payloads) if a call fails while
        // requests are posted: MPI may still touch them. A header an any-source receive held
        // back for a peer is the first receive's from that peer.
        let mut held = self.p2p_held.lock().unwrap_or_else(|e| e.into_inner());
        let mut headers: Vec<[u8; FP_BYTES]> = Vec::with_capacity(jobs.len());
        let mut from_held = Vec::with_capacity(jobs.len());
        for j in jobs.iter() {
            let h = if j.is_send { None } else { held.remove(&j.peer) };
            from_held.push(h.is_some());
            headers.push(h.unwrap_or(if j.is_send { j.header } else { [0u8; FP_BYTES] }));
        }
        drop(held);
        let posted = post(
            c,
            jobs.iter()
                .zip(headers.iter_mut())
                .zip(&from_held)
                .filter(|(_, &held)| !held)
                .map(|((j, h), _)| (j.peer, j.is_send, &mut h[..])),
            TAG_HEADER,
        )
        .and_then(|mut reqs| wait_all(&mut reqs, "MPI_Waitall (p2p headers)"));
        if let Err(e) = posted {
            std::mem::forget(headers);
            leak_payloads(jobs);
            return Err(e);
        }
        for (job, got) in jobs.iter().zip(&headers) {
            if !job.is_send {
                job.check_header(got)?;
            }
        }
        let posted = post(c, jobs.iter_mut().map(|j| (j.peer, j.is_send, &mut j.bytes[..])), TAG_PAYLOAD)
            .and_then(|mut reqs| wait_all(&mut reqs, "MPI_Waitall (p2p payloads)"));
        if let Err(e) = posted {
            leak_payloads(jobs);
            return Err(e);
        }
        for job in jobs.iter() {
            let bytes = FP_BYTES + job.bytes.len();
            if job.is_send {
                add(stats, bytes, 0);
            } else {
                add(stats, 0, bytes);
            }
        }
        Ok(())
    }
}

impl MpiBackend {
    /// A receive from any source (see [`P2pMsg::any_of`]): polls the candidates in order for
    /// a header (`MPI_Iprobe`, then `MPI_Recv` of it); one that is not this receive's is held
    /// for the receive it is meant for, and that peer is not looked at again until then.
    /// Gives up at the deadline, naming what each candidate sent next.
    fn recv_any(&self, env: &mut OpEnv<'_>, job: &mut P2pMsg) -> Result<()> {
        let c = self.p2p.0;
        let deadline = Instant::now() + env.timeout;
        let mut spins = 0u32;
        let found = loop {
            let mut held = self.p2p_held.lock().unwrap_or_else(|e| e.into_inner());
            let mut found = None;
            for i in 0..job.any_of.len() {
                let peer = job.any_of[i].0;
                if let std::collections::hash_map::Entry::Vacant(slot) = held.entry(peer) {
                    let mut flag: c_int = 0;
                    // SAFETY: `c` is valid; `flag` is a place for MPI to write; the status
                    // is ignored.
                    mpi_call("MPI_Iprobe", unsafe {
                        ffi::MPI_Iprobe(peer as c_int, TAG_HEADER, c, &mut flag, ffi::RSMPI_STATUS_IGNORE)
                    })?;
                    if flag == 0 {
                        continue;
                    }
                    let mut h = [0u8; FP_BYTES];
                    // SAFETY: `h` holds FP_BYTES bytes; the probe found a header from `peer`,
                    // so this returns at once.
                    mpi_call("MPI_Recv (p2p header)", unsafe {
                        ffi::MPI_Recv(
                            rp(&mut h[..]),
                            FP_BYTES as c_int,
                            bytes_type(),
                            peer as c_int,
                            TAG_HEADER,
                            c,
                            ffi::RSMPI_STATUS_IGNORE,
                        )
                    })?;
                    slot.insert(h);
                }
                if job.fits_any(i, &held[&peer])? {
                    held.remove(&peer);
                    found = Some(i);
                    break;
                }
            }
            if let Some(i) = found {
                break i;
            }
            if Instant::now() >= deadline {
                let peers: Vec<usize> = job.any_of.iter().map(|&(p, _)| p).collect();
                let mut msg = format!(
                    "timed out after {:?} waiting for a message with tag {} from any of ranks {peers:?}",
                    env.timeout, job.fp.extra
                );
                for (peer, h) in held.iter() {
                    if let Ok(fp) = crate::wire::Fingerprint::decode(h) {
                        msg.push_str(&format!("; rank {peer}'s next message is {fp}"));
                    }
                }
                return Err(Error::new(ErrorKind::Timeout, msg));
            }
            drop(held);
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        };
        job.take_sender(found);
        let len = count(job.bytes.len())?;
        // SAFETY: `job.bytes` holds `len` bytes; the sender posts this payload right after
        // the header this receive took.
        mpi_call("MPI_Recv (p2p payload)", unsafe {
            ffi::MPI_Recv(
                rp(&mut job.bytes[..]),
                len,
                bytes_type(),
                job.peer as c_int,
                TAG_PAYLOAD,
                c,
                ffi::RSMPI_STATUS_IGNORE,
            )
        })?;
        add(env.stats, 0, FP_BYTES + job.bytes.len());
        Ok(())
    }

    /// `MPI_Allreduce` in place (`op` is a combiner; the communicator finishes `Avg`).
    fn all_reduce_in<T: Element>(
        &self,
        g: &GroupView<'_>,
        c: ffi::MPI_Comm,
        buf: &mut [T],
        op: ReduceOp,
        stats: &mut LinkStats,
    ) -> Result<()> {
        let (n, mop, len) = (g.size(), self.op::<T>(op)?, count(buf.len())?);
        // SAFETY: in place on `buf`, `len` elements of the datatype of T; `c` is valid.
        mpi_call("MPI_Allreduce", unsafe { ffi::MPI_Allreduce(in_place(), rp(buf), len, datatype(T::DTYPE), mop, c) })?;
        let share = ring_share(2 * std::mem::size_of_val(buf), n);
        add(stats, share, share);
        Ok(())
    }
}

/// Posts one `MPI_Isend` or `MPI_Irecv` of bytes per item; returns the requests.
fn post<'a>(
    c: ffi::MPI_Comm,
    items: impl Iterator<Item = (usize, bool, &'a mut [u8])>,
    tag: c_int,
) -> Result<Vec<ffi::MPI_Request>> {
    let mut reqs = Vec::new();
    for (peer, is_send, buf) in items {
        let len = count(buf.len())?;
        // SAFETY: a null request is a valid place for MPI to write the new one.
        let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `buf` holds `len` bytes and outlives the request (the caller waits for it,
        // or leaks the buffer); `peer` is a rank of `c`.
        let rc = unsafe {
            if is_send {
                ffi::MPI_Isend(sp(buf), len, bytes_type(), peer as c_int, tag, c, &mut req)
            } else {
                ffi::MPI_Irecv(rp(buf), len, bytes_type(), peer as c_int, tag, c, &mut req)
            }
        };
        mpi_call(if is_send { "MPI_Isend" } else { "MPI_Irecv" }, rc)?;
        reqs.push(req);
    }
    Ok(reqs)
}

/// Leaks every payload buffer of `jobs` (MPI may still write them after a failed call).
fn leak_payloads(jobs: &mut [P2pMsg]) {
    for job in jobs {
        std::mem::forget(std::mem::take(&mut job.bytes));
    }
}

/// `MPI_Allgather` of `input` into `output` (n × input).
fn all_gather_in<T: Element>(
    g: &GroupView<'_>,
    c: ffi::MPI_Comm,
    input: &[T],
    output: &mut [T],
    stats: &mut LinkStats,
) -> Result<()> {
    let (len, dt) = (count(input.len())?, datatype(T::DTYPE));
    count(output.len())?;
    // SAFETY: `input` holds `len` elements, `output` n × `len` (checked by the caller), of
    // T's datatype; the two are distinct.
    mpi_call("MPI_Allgather", unsafe { ffi::MPI_Allgather(sp(input), len, dt, rp(output), len, dt, c) })?;
    let share = (g.size() - 1) * std::mem::size_of_val(input);
    add(stats, share, share);
    Ok(())
}

/// `MPI_Comm_split(c, color or MPI_UNDEFINED, key)`; the new communicator returns errors.
fn split_comm(c: ffi::MPI_Comm, color: Option<usize>, key: usize) -> Result<Option<Comm>> {
    // SAFETY: a read-only constant set by rsmpi's C shim.
    let undefined = unsafe { ffi::RSMPI_UNDEFINED };
    let color = match color {
        Some(k) => c_int::try_from(k).map_err(|_| Error::invalid("too many colors for MPI"))?,
        None => undefined,
    };
    let key = c_int::try_from(key).map_err(|_| Error::invalid("too many ranks for MPI"))?;
    // SAFETY: a null handle is a valid place for MPI to write the new communicator.
    let mut out: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: `c` is a valid communicator and `out` a valid out-pointer.
    mpi_call("MPI_Comm_split", unsafe { ffi::MPI_Comm_split(c, color, key, &mut out) })?;
    if color == undefined {
        return Ok(None);
    }
    // SAFETY: `out` is the communicator just created; RSMPI_ERRORS_RETURN is a constant.
    mpi_call("MPI_Comm_set_errhandler", unsafe { ffi::MPI_Comm_set_errhandler(out, ffi::RSMPI_ERRORS_RETURN) })?;
    Ok(Some(Handle(out)))
}
