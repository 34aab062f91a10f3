//! Mismatches, deadlines, aborts, bad arguments, async ordering, groups and point-to-point.

use std::time::{Duration, Instant};

use oxcomm::{threads, CommConfig, Communicator, ErrorKind, ReduceOp, Result};

fn config(timeout_ms: u64) -> CommConfig {
    CommConfig { timeout: Duration::from_millis(timeout_ms), ..CommConfig::default() }
}

fn input(rank: usize, count: usize) -> Vec<f32> {
    (0..count).map(|i| (rank * 10 + i % 7) as f32).collect()
}

/// Runs `f` on 4 ranks and requires every rank to fail with `kind` and keep its buffer.
fn every_rank_fails(kind: ErrorKind, f: impl Fn(&Communicator, &mut Vec<f32>) -> Result<()> + Sync) {
    let out = threads::run_with(4, config(5_000), |comm| {
        let mut buf = input(comm.rank(), 1000);
        let before = buf.clone();
        let r = f(&comm, &mut buf);
        (comm.rank(), r, buf == before)
    })
    .unwrap();
    for (rank, r, untouched) in out {
        let e = r.expect_err(&format!("rank {rank} did not fail"));
        assert_eq!(e.kind(), kind, "rank {rank}: {e}");
        assert!(untouched, "rank {rank}: buffer changed by a failed op");
        assert_eq!(e.rank(), Some(rank), "{e}");
    }
}

#[test]
fn count_mismatch_fails_everywhere_and_names_both() {
    let out = threads::run_with(4, config(5_000), |comm| {
        let mut buf = input(comm.rank(), if comm.rank() == 2 { 999 } else { 1000 });
        let before = buf.clone();
        let r = comm.all_reduce(&mut buf, ReduceOp::Sum);
        (r, buf == before)
    })
    .unwrap();
    for (rank, (r, untouched)) in out.into_iter().enumerate() {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
        assert!(untouched);
        let msg = e.to_string();
        assert!(msg.contains("999") && msg.contains("1000"), "both fingerprints named: {msg}");
        // Ranks 0, 1 and 3 name rank 2. Rank 2 names the rank that told it first: rank 0's
        // verdict, or a revocation of rank 1 or 3 that overtook it (both ops shown either way).
        let other = e.peer().expect("a mismatch names a peer");
        if rank == 2 {
            assert!([0, 1, 3].contains(&other), "{msg}");
        } else {
            assert_eq!(other, 2, "{msg}");
        }
        assert!(msg.contains(&format!("rank {other}")), "{msg}");
    }
}

#[test]
fn op_dtype_root_and_kind_mismatches() {
    every_rank_fails(ErrorKind::Mismatch, |c, b| {
        let op = if c.rank() == 1 { ReduceOp::Max } else { ReduceOp::Sum };
        c.all_reduce(b, op)
    });
    every_rank_fails(ErrorKind::Mismatch, |c, b| {
        if c.rank() == 3 {
            let mut ints: Vec<i32> = b.iter().map(|x| *x as i32).collect();
            c.all_reduce(&mut ints, ReduceOp::Sum)
        } else {
            c.all_reduce(b, ReduceOp::Sum)
        }
    });
    every_rank_fails(ErrorKind::Mismatch, |c, b| c.broadcast(b, if c.rank() == 0 { 1 } else { 0 }));
    every_rank_fails(ErrorKind::Mismatch, |c, b| {
        if c.rank() == 0 {
            c.broadcast(b, 0)
        } else {
            c.all_reduce(b, ReduceOp::Sum)
        }
    });
    // A rank that skipped an op is one sequence number behind.
    every_rank_fails(ErrorKind::Mismatch, |c, b| {
        if c.rank() != 1 {
            c.barrier()?;
        }
        let r = c.all_reduce(b, ReduceOp::Sum);
        if c.rank() == 1 {
            r
        } else {
            // The others fail on the first op after the skipped one: report that.
            r
        }
    });
}

#[test]
fn a_missing_rank_is_named_by_everyone_within_the_deadline() {
    let timeout = Duration::from_millis(1000);
    // Times are measured from one instant before any rank starts: the others learn of the
    // missing rank from rank 0, at rank 0's deadline, which is `timeout` after rank 0 began
    // waiting; a rank that started later than rank 0 (a loaded machine) hears it less than
    // `timeout` after its own start (issue 16: this made the test flaky).
    let t0 = Instant::now();
    let out = threads::run_with(4, CommConfig { timeout, ..CommConfig::default() }, |comm| {
        if comm.rank() == 3 {
            std::thread::sleep(timeout * 3);
            return None;
        }
        let mut buf = input(comm.rank(), 16);
        let r = comm.all_reduce(&mut buf, ReduceOp::Sum);
        Some((r, t0.elapsed()))
    })
    .unwrap();
    for (rank, o) in out.into_iter().enumerate().take(3) {
        let (r, took) = o.unwrap();
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "rank {rank}: {e}");
        assert_eq!(e.peer(), Some(3), "rank {rank}: {e}");
        // Rank 0's deadline, then at most the verdict's grace (0.5 s) and scheduling slack.
        assert!(took >= timeout && took < timeout + Duration::from_secs(2), "rank {rank} took {took:?}");
    }
}

#[test]
fn a_missing_root_is_named_too() {
    let timeout = Duration::from_millis(800);
    let out = threads::run_with(3, CommConfig { timeout, ..CommConfig::default() }, |comm| {
        if comm.rank() == 0 {
            std::thread::sleep(timeout * 3);
            return None;
        }
        let t0 = Instant::now();
        Some((comm.barrier(), t0.elapsed()))
    })
    .unwrap();
    for o in out.into_iter().skip(1) {
        let (r, took) = o.unwrap();
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert_eq!(e.peer(), Some(0), "{e}");
        // The others wait half a second longer than the root would have (the verdict's
        // grace), plus scheduling slack on a loaded machine.
        assert!(took < timeout + Duration::from_millis(1500), "took {took:?}");
    }
}

#[test]
fn after_an_error_every_op_fails_at_once_with_the_cause() {
    let out = threads::run_with(2, config(500), |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let mut b = [1.0f32; 4];
        let first = comm.all_reduce(&mut b, ReduceOp::Sum).unwrap_err();
        let t0 = Instant::now();
        let later = comm.barrier().unwrap_err();
        Some((first, later, t0.elapsed()))
    })
    .unwrap();
    let (first, later, took) = out[0].clone().unwrap();
    assert_eq!(first.kind(), ErrorKind::Timeout);
    assert_eq!(later.kind(), ErrorKind::Aborted);
    assert!(later.to_string().contains("timed out"), "{later}");
    assert!(later.to_string().contains("barrier"), "{later}");
    // At once: well under the 500 ms deadline, with room for a descheduled thread on a
    // loaded machine (a 50 ms bound is a timing dependence, issue 16).
    assert!(took < Duration::from_millis(250), "{took:?}");
}

#[test]
fn a_panicking_rank_is_noticed_promptly() {
    let t0 = Instant::now();
    let r = threads::run_with(3, config(30_000), |comm| {
        if comm.rank() == 1 {
            panic!("boom");
        }
        let mut b = vec![1.0f32; 1 << 16];
        comm.all_reduce(&mut b, ReduceOp::Sum)
    });
    let e = r.unwrap_err();
    assert!(e.to_string().contains("rank 1 panicked"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
}

#[test]
fn survivors_of_a_dead_rank_get_peer_gone() {
    let out = threads::run_with(3, config(30_000), |comm| {
        if comm.rank() == 2 {
            return None; // returns at once: its links close
        }
        let t0 = Instant::now();
        let mut b = vec![1.0f32; 1 << 16];
        let r = comm.all_reduce(&mut b, ReduceOp::Sum);
        Some((r, t0.elapsed()))
    })
    .unwrap();
    for o in out.into_iter().take(2) {
        let (r, took) = o.unwrap();
        let e = r.unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::Timeout), "{e}");
        assert!(took < Duration::from_secs(2), "took {took:?}: {e}");
        // Rank 0 waits for rank 2 directly; rank 1 learns it from rank 0's verdict or exit.
    }
}

#[test]
fn bad_arguments_are_rejected_before_communicating() {
    let out = threads::run_with(2, config(5_000), |comm| {
        let mut errs = Vec::new();
        let input = [1.0f32; 5];
        let mut out = [0.0f32; 2];
        errs.push(comm.reduce_scatter(&input, &mut out, ReduceOp::Sum).unwrap_err());
        let mut b = [1.0f32; 4];
        errs.push(comm.broadcast(&mut b, 2).unwrap_err());
        errs.push(comm.reduce(&mut b, 7, ReduceOp::Sum).unwrap_err());
        errs.push(comm.all_reduce(&mut b, ReduceOp::BXor).unwrap_err());
        let mut small = [0.0f32; 3];
        errs.push(comm.all_gather(&b, &mut small).unwrap_err());
        errs.push(comm.new_group(&[0, 0]).unwrap_err());
        errs.push(comm.new_group(&[0, 5]).unwrap_err());
        let mut r = [0.0f32; 4];
        errs.push(comm.all_to_all_v(&b, &[1, 1], &mut r, &[2, 2]).unwrap_err());
        errs.push(comm.send(&b, comm.rank(), 0).unwrap_err());
        // The communicator still works.
        comm.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        (errs, b)
    })
    .unwrap();
    for (errs, b) in out {
        for e in errs {
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        }
        assert_eq!(b, [2.0; 4]);
    }
}

#[test]
fn async_ops_complete_in_issue_order() {
    let out = threads::run(4, |comm| {
        let works: Vec<_> =
            (0..8).map(|k| comm.all_reduce_async(vec![k as f64 + comm.rank() as f64; 1000], ReduceOp::Sum)).collect();
        // A sync op after async ones waits for them.
        let mut b = [1i32; 3];
        comm.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        let mut results = Vec::new();
        for w in works.into_iter().rev() {
            results.push(w.wait().unwrap()[0]);
        }
        results.reverse();
        let g = comm.all_gather_async(vec![comm.rank() as u8; 2]).wait().unwrap();
        let rs = comm.reduce_scatter_async(vec![1i64; 8], ReduceOp::Sum).wait().unwrap();
        let bc = comm.broadcast_async(vec![comm.rank() as f32; 3], 2).wait().unwrap();
        comm.barrier_async().wait().unwrap();
        (results, b, g, rs, bc)
    })
    .unwrap();
    for (results, b, g, rs, bc) in out {
        let want: Vec<f64> = (0..8).map(|k| 4.0 * k as f64 + 6.0).collect();
        assert_eq!(results, want);
        assert_eq!(b, [4; 3]);
        assert_eq!(g, vec![0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(rs, vec![4, 4]);
        assert_eq!(bc, vec![2.0; 3]);
    }
}

#[test]
fn run_async_holds_one_turn_for_a_composite_op() {
    // A composite op of three all-reduces issued async, then a sync all-reduce from another
    // thread of the same rank: on every rank the three run first, back to back, so the sums
    // line up (a different interleaving on one rank would mismatch or mix the values).
    let out = threads::run(3, |comm| {
        let work = comm.run_async(|c| {
            let mut v = vec![c.rank() as i64; 5];
            for _ in 0..3 {
                c.all_reduce(&mut v, ReduceOp::Sum)?;
            }
            Ok(v)
        });
        let other = comm.clone();
        let sync = std::thread::spawn(move || {
            let mut w = [100i32 + other.rank() as i32; 2];
            other.all_reduce(&mut w, ReduceOp::Sum).map(|_| w)
        });
        let sync = sync.join().unwrap();
        // An error inside the closure completes the handle and later ops still run.
        let bad = comm.run_async(|c| c.all_reduce(&mut [1.0f32], ReduceOp::BAnd)).wait();
        let after = comm.run_async(|c| {
            let mut v = [1u8; 2];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v)
        });
        (work.wait(), sync, bad, after.wait())
    })
    .unwrap();
    for (composite, sync, bad, after) in out {
        // 0+1+2 = 3, then 3·3 = 9, then 27.
        assert_eq!(composite.unwrap(), vec![27; 5]);
        assert_eq!(sync.unwrap(), [303; 2]);
        assert_eq!(bad.unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(after.unwrap(), [3, 3]);
    }
}

#[test]
fn abort_from_another_thread_ends_an_op_that_waits() {
    // Rank 1 never joins the all-reduce; rank 0's op waits (deadline 60 s) until another
    // thread of rank 0 aborts the communicator: the op must end within a few peer checks.
    let out = threads::run_with(2, config(60_000), |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(800));
            return None;
        }
        let other = comm.clone();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let t = Instant::now();
            other.abort("test: interrupted");
            t
        });
        let err = comm.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum).unwrap_err();
        let aborted_at = aborter.join().unwrap();
        Some((err, aborted_at.elapsed()))
    })
    .unwrap();
    let (err, since_abort) = out[0].clone().expect("rank 0 ran the op");
    assert_eq!(err.kind(), ErrorKind::Aborted, "{err}");
    assert!(since_abort < Duration::from_secs(2), "the op ended {since_abort:?} after the abort");
}

#[test]
fn members_group_needs_no_call_from_non_members() {
    let out = threads::run(4, |comm| {
        // Ranks 1 and 3 never call members_group for [3, 1]'s complement, and vice versa.
        let mine: &[usize] = if comm.rank() % 2 == 0 { &[2, 0] } else { &[1, 3] };
        let g = comm.members_group(mine).unwrap().expect("a member");
        let mut v = [comm.rank() as f32 + 1.0; 3];
        g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        // A second group of the same list is a different group, made in the same order.
        let g2 = comm.members_group(mine).unwrap().unwrap();
        let mut ranks = vec![0i32; 2];
        g2.all_gather(&[comm.rank() as i32], &mut ranks).unwrap();
        let outside = comm.members_group(&[(comm.rank() + 1) % 4]).unwrap();
        let dup = comm.members_group(&[0, 0]).unwrap_err();
        // The world still works after groups made on members only.
        let mut w = [1i32];
        comm.all_reduce(&mut w, ReduceOp::Sum).unwrap();
        (comm.rank(), g.rank(), v, ranks, outside.is_none(), dup.kind(), w)
    })
    .unwrap();
    for (rank, group_rank, v, ranks, outside_none, dup, w) in out {
        let want = if rank % 2 == 0 { 4.0 } else { 6.0 };
        assert_eq!(v, [want; 3]);
        assert_eq!(group_rank, if rank % 2 == 0 { 1 - rank / 2 } else { rank / 2 });
        assert_eq!(ranks, if rank % 2 == 0 { vec![2, 0] } else { vec![1, 3] });
        assert!(outside_none);
        assert_eq!(dup, ErrorKind::InvalidArgument);
        assert_eq!(w, [4]);
    }
}

#[test]
fn work_handles_poll_and_wait_with_timeout() {
    threads::run(2, |comm| {
        let mut w = comm.all_reduce_async(vec![1.0f32; 4], ReduceOp::Sum);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !w.is_completed() {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(1));
        }
        let v = w.wait_timeout(Duration::from_secs(5)).unwrap().unwrap();
        assert_eq!(v, vec![2.0; 4]);
        assert_eq!(w.wait_timeout(Duration::ZERO).unwrap_err().kind(), ErrorKind::InvalidArgument);
        // An async op whose argument is bad fails, and later ops still run in order.
        let bad = comm.all_reduce_async(vec![1.0f32; 4], ReduceOp::BAnd).wait().unwrap_err();
        assert_eq!(bad.kind(), ErrorKind::InvalidArgument);
        assert_eq!(comm.all_reduce_async(vec![1u8; 2], ReduceOp::Sum).wait().unwrap(), vec![2, 2]);
    })
    .unwrap();
}

#[test]
fn groups_and_split() {
    let out = threads::run(5, |comm| {
        let evens = comm.new_group(&[0, 2, 4]).unwrap();
        let odds = comm.new_group(&[3, 1]).unwrap();
        let mut world = [1.0f32; 3];
        let mut in_group = [comm.rank() as f32; 3];
        if let Some(g) = &evens {
            g.all_reduce(&mut in_group, ReduceOp::Sum).unwrap();
        }
        if let Some(g) = &odds {
            assert_eq!(g.rank(), if comm.rank() == 3 { 0 } else { 1 });
            g.all_reduce(&mut in_group, ReduceOp::Max).unwrap();
            g.barrier().unwrap();
        }
        comm.all_reduce(&mut world, ReduceOp::Sum).unwrap();
        let by_parity = comm.split(Some((comm.rank() % 2) as u32), -(comm.rank() as i64)).unwrap().unwrap();
        let mut members = vec![0u8; by_parity.size()];
        by_parity.all_gather(&[comm.rank() as u8], &mut members).unwrap();
        let none = comm.split(if comm.rank() == 4 { None } else { Some(7) }, 0).unwrap();
        (evens.map(|g| g.size()), in_group[0], world[0], members, none.map(|g| g.size()))
    })
    .unwrap();
    for (rank, (evens, v, world, members, none)) in out.into_iter().enumerate() {
        assert_eq!(evens, (rank % 2 == 0).then_some(3));
        let want = if rank % 2 == 0 { 6.0 } else { 3.0 };
        assert_eq!(v, want, "rank {rank}");
        assert_eq!(world, 5.0);
        let want_members: Vec<u8> = if rank % 2 == 0 { vec![4, 2, 0] } else { vec![3, 1] };
        assert_eq!(members, want_members);
        assert_eq!(none, (rank != 4).then_some(4));
    }
}

#[test]
fn send_recv_and_nonblocking_exchange() {
    threads::run(3, |comm| {
        let (r, n) = (comm.rank(), comm.size());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        if r == 0 {
            comm.send(&[r as i32; 5], next, 7).unwrap();
            let mut b = [0i32; 5];
            comm.recv(&mut b, prev, 7).unwrap();
            assert_eq!(b, [prev as i32; 5]);
        } else {
            let mut b = [0i32; 5];
            comm.recv(&mut b, prev, 7).unwrap();
            assert_eq!(b, [prev as i32; 5]);
            comm.send(&[r as i32; 5], next, 7).unwrap();
        }
        // An exchange larger than the links' buffers, both directions at once.
        let big = 3 << 20;
        let s = comm.isend(vec![r as f32; big], next, 1);
        let rv = comm.irecv(vec![0.0f32; big], prev, 1);
        let got = rv.wait().unwrap();
        assert!(got.iter().all(|x| *x == prev as f32));
        assert_eq!(s.wait().unwrap().len(), big);
    })
    .unwrap();
}

#[test]
fn p2p_tag_or_size_mismatch_fails_without_writing() {
    let out = threads::run_with(2, config(3_000), |comm| {
        if comm.rank() == 0 {
            comm.send(&[1.0f32; 4], 1, 5).map(|_| None)
        } else {
            let mut b = [0.0f32; 4];
            let r = comm.recv(&mut b, 0, 6);
            r.map(|_| Some(b)).inspect_err(|_| assert_eq!(b, [0.0; 4]))
        }
    })
    .unwrap();
    let e = out[1].clone().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
    assert!(e.to_string().contains("tag 5") && e.to_string().contains("tag 6"), "{e}");
}

#[test]
fn monitored_barrier_lists_every_missing_rank() {
    let out = threads::run_with(5, config(10_000), |comm| {
        if comm.rank() == 2 || comm.rank() == 4 {
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let t0 = Instant::now();
        Some((comm.monitored_barrier(Duration::from_millis(500)), t0.elapsed()))
    })
    .unwrap();
    let (r, took) = out[0].clone().unwrap();
    let e = r.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.to_string().contains("2, 4"), "{e}");
    assert!(took < Duration::from_millis(1400), "{took:?}");
    let (r1, _) = out[1].clone().unwrap();
    assert!(r1.unwrap_err().to_string().contains("2, 4"));
}

#[test]
fn coalesced_ops() {
    let out = threads::run(3, |comm| {
        let r = comm.rank() as i32;
        let mut a = vec![r; 3];
        let mut b: [i32; 0] = [];
        let mut c = vec![1; 5];
        comm.all_reduce_coalesced(&mut [&mut a[..], &mut b[..], &mut c[..]], ReduceOp::Sum).unwrap();
        let x = [r; 2];
        let y = [r + 10; 1];
        let mut ox = [0; 6];
        let mut oy = [0; 3];
        comm.all_gather_coalesced(&[&x[..], &y[..]], &mut [&mut ox[..], &mut oy[..]]).unwrap();
        (a, c, ox, oy)
    })
    .unwrap();
    for (a, c, ox, oy) in out {
        assert_eq!(a, vec![3; 3]);
        assert_eq!(c, vec![3; 5]);
        assert_eq!(ox, [0, 0, 1, 1, 2, 2]);
        assert_eq!(oy, [10, 11, 12]);
    }
}

/// Rank 0's error from `op` on a pair whose own timeout is 300 ms, in a world that waits up to
/// 60 s (torch's `new_group(timeout=...)`); rank 1 stays away, outside oxcomm, until rank 0
/// has its result.
fn error_on_a_pair_with_its_own_timeout(op: impl Fn(&Communicator) -> Result<()> + Sync) -> oxcomm::Error {
    let done = (std::sync::Mutex::new(false), std::sync::Condvar::new());
    let out = threads::run_with(2, config(60_000), |world| {
        let pair = world.new_group(&[0, 1]).unwrap().unwrap();
        pair.set_timeout(Duration::from_millis(300));
        assert_eq!(world.timeout(), Duration::from_secs(60));
        if world.rank() == 0 {
            let r = op(&pair);
            *done.0.lock().unwrap() = true;
            done.1.notify_all();
            r
        } else {
            let until = Instant::now() + Duration::from_secs(60);
            let mut g = done.0.lock().unwrap();
            while !*g && Instant::now() < until {
                g = done.1.wait_timeout(g, Duration::from_millis(100)).unwrap().0;
            }
            Ok(())
        }
    })
    .unwrap();
    out.into_iter().next().unwrap().unwrap_err()
}

#[test]
fn a_groups_own_timeout_applies_to_its_ops_only() {
    let e = error_on_a_pair_with_its_own_timeout(|pair| pair.barrier());
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.message().contains("300ms"), "the group's timeout, not the world's: {e}");
}

#[test]
fn a_groups_own_timeout_applies_to_its_pending_p2p() {
    // An `irecv` that rank 1 never answers: the batch it starts in gives up at the pair's
    // timeout too.
    let e = error_on_a_pair_with_its_own_timeout(|pair| pair.irecv(vec![0u8; 4], 1, 3).wait().map(|_| ()));
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.message().contains("300ms"), "the group's timeout, not the world's: {e}");
}
