//! Receiving from any source (`recv_any`, `irecv_any`): on thread ranks here, and the same
//! scenario over shared memory, TCP and shm+TCP from `multiproc` (role `any_source`) and over
//! MPI from `tests/mpi`.
//!
//! What it holds: the first message with the tag from any member is taken and its sender
//! returned; each sender's messages arrive in the order sent; a message with another tag at
//! the head of a sender's stream is left for its own receive; an `irecv_any` posted with
//! `isend`s cannot deadlock an exchange; a group's receive sees only its members; links are
//! clean afterwards (a collective follows). And the failures: a same-tag message of another
//! size is a mismatch naming the sender, a wait nobody answers times out saying what each
//! member sent next, and a member that dies while this rank waits is named.

use std::time::Duration;

use oxcomm::{threads, CommConfig, Communicator, ErrorKind, ReduceOp};

/// Messages each sender sends in the ordering part.
const PER_SENDER: usize = 5;

/// The whole scenario on one rank of any transport; returns what went wrong (empty: all good).
/// Needs at least 2 ranks; the tag-skipping and group parts need 3.
pub fn scenario(comm: &Communicator) -> Vec<String> {
    let mut bad = Vec::new();
    if let Err(e) = run(comm, &mut bad) {
        bad.push(format!("rank {}: {e}", comm.rank()));
    }
    bad
}

fn run(comm: &Communicator, bad: &mut Vec<String>) -> oxcomm::Result<()> {
    let (me, n) = (comm.rank(), comm.size());
    // 1. Rank 0 takes every other rank's messages in arrival order; per sender, in send order.
    if me == 0 {
        let mut next = vec![0i64; n];
        for _ in 0..(n - 1) * PER_SENDER {
            let mut buf = [0i64; 3];
            let src = comm.recv_any(&mut buf, 7)?;
            if buf[0] != src as i64 || buf[1] != next[src] || buf[2] != 42 {
                bad.push(format!("from rank {src}: got {buf:?}, expected [{src}, {}, 42]", next[src]));
            }
            next[src] += 1;
        }
        if next[1..].iter().any(|&k| k != PER_SENDER as i64) {
            bad.push(format!("messages per sender: {next:?}"));
        }
    } else {
        for i in 0..PER_SENDER {
            comm.send(&[me as i64, i as i64, 42], 0, 7)?;
        }
    }
    // 2. A head message with another tag waits for its own receive.
    if n >= 3 {
        match me {
            0 => {
                let mut buf = [0u32; 4];
                let src = comm.recv_any(&mut buf, 5)?;
                if src != 2 || buf != [2; 4] {
                    bad.push(format!("tag 5 from any: rank {src} sent {buf:?}, expected rank 2's [2; 4]"));
                }
                let mut first = [0u32; 4];
                comm.recv(&mut first, 1, 3)?;
                if first != [1; 4] {
                    bad.push(format!("tag 3 from rank 1 after the skip: {first:?}"));
                }
            }
            1 => {
                comm.send(&[1u32; 4], 0, 3)?;
                // Only now may rank 2 send: rank 1's tag-3 message is at the head first.
                comm.send(&[0u8], 2, 9)?;
            }
            2 => {
                comm.recv(&mut [0u8], 1, 9)?;
                comm.send(&[2u32; 4], 0, 5)?;
            }
            _ => {}
        }
    }
    // 3. An exchange with irecv_any and isend, all pending together: no deadlock.
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    let recv = comm.irecv_any(vec![0.0f32; 16], 11);
    let send = comm.isend(vec![me as f32; 16], right, 11);
    let (got, src) = recv.wait()?;
    send.wait()?;
    if src != left || got.iter().any(|&x| x != left as f32) {
        bad.push(format!("exchange: got {:?} from rank {src}, expected rank {left}'s", &got[..2]));
    }
    // 4. A group's receive sees only its members (world rank 1 talks to 0 on the world too).
    if n >= 3 {
        let group = comm.new_group(&[0, 2])?;
        match me {
            0 => {
                let g = group.as_ref().expect("rank 0 is in the group");
                let mut buf = [0u16; 2];
                let src = g.recv_any(&mut buf, 1)?;
                if src != 1 || buf != [22; 2] {
                    bad.push(format!("group recv_any: group rank {src} sent {buf:?}, expected group rank 1's [22; 2]"));
                }
                let mut world = [0u16; 2];
                comm.recv(&mut world, 1, 1)?;
                if world != [11; 2] {
                    bad.push(format!("world message after the group's: {world:?}"));
                }
            }
            1 => comm.send(&[11u16; 2], 0, 1)?,
            2 => group.as_ref().expect("rank 2 is in the group").send(&[22u16; 2], 0, 1)?,
            _ => {}
        }
    }
    // 5. Nothing left in any link: a collective after it all.
    let mut sum = [1.0f64];
    comm.all_reduce(&mut sum, ReduceOp::Sum)?;
    if sum[0] != n as f64 {
        bad.push(format!("all_reduce after: {}", sum[0]));
    }
    Ok(())
}

fn config(timeout_ms: u64) -> CommConfig {
    CommConfig { timeout: Duration::from_millis(timeout_ms), ..CommConfig::default() }
}

#[test]
fn recv_any_on_threads() {
    for n in [2, 3, 4] {
        let out = threads::run(n, |comm| scenario(&comm)).unwrap();
        for (r, bad) in out.iter().enumerate() {
            assert!(bad.is_empty(), "{n} ranks, rank {r}: {bad:#?}");
        }
    }
}

#[test]
fn recv_any_of_another_size_is_a_mismatch_naming_the_sender() {
    let out = threads::run_with(2, config(10_000), |comm| {
        if comm.rank() == 0 {
            let mut buf = [0i32; 4];
            comm.recv_any(&mut buf, 3).map(|_| buf)
        } else {
            comm.send(&[1i32; 5], 0, 3).map(|()| [0; 4])
        }
    })
    .unwrap();
    let e = out[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
    assert_eq!(e.peer(), Some(1), "{e}");
    assert!(e.message().contains("any source"), "{e}");
}

#[test]
fn recv_any_that_nobody_answers_times_out_saying_what_came_instead() {
    let out = threads::run_with(3, config(600), |comm| {
        match comm.rank() {
            0 => {
                let r = comm.recv_any(&mut [0u8; 2], 8).map(|_| ());
                (r, Ok(()))
            }
            // Rank 1 sends with another tag; its send completes (small), then it waits for
            // rank 0, which failed: that wait fails too.
            1 => (comm.send(&[1u8; 2], 0, 4), comm.barrier()),
            _ => (Ok(()), comm.barrier()),
        }
    })
    .unwrap();
    let e = out[0].0.as_ref().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.message().contains("tag 8"), "names the tag it waited for: {e}");
    assert!(e.message().contains("rank 1's next message is send/recv #0 (u8 × 2, tag 4)"), "{e}");
}

#[test]
fn recv_any_names_a_member_that_dies_while_it_waits() {
    let out = threads::run_with(3, config(20_000), |comm| match comm.rank() {
        0 => comm.recv_any(&mut [0u8; 2], 1).map(|_| ()),
        // Rank 1 leaves (drops its communicator); rank 2 waits for rank 0, which fails.
        1 => Ok(()),
        _ => comm.recv(&mut [0u8; 1], 0, 2),
    })
    .unwrap();
    let e = out[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
    assert_eq!(e.peer(), Some(1), "{e}");
    assert!(out[2].is_err(), "rank 2 hears of the failure");
}

#[test]
fn receives_after_an_any_source_receive_in_one_batch_keep_the_order() {
    // Rank 0 posts irecv_any then irecv from rank 1 (same tag); rank 1 sends two messages:
    // the first goes to the any-source receive, posted first (as MPI matches them).
    type Got = Option<(usize, Vec<u8>, Vec<u8>)>;
    let out = threads::run(2, |comm| -> oxcomm::Result<Got> {
        if comm.rank() == 0 {
            let any = comm.irecv_any(vec![0u8; 3], 6);
            let named = comm.irecv(vec![0u8; 3], 1, 6);
            let (a, src) = any.wait()?;
            let b = named.wait()?;
            Ok(Some((src, a, b)))
        } else {
            comm.send(&[1u8; 3], 0, 6)?;
            comm.send(&[2u8; 3], 0, 6)?;
            Ok(None)
        }
    })
    .unwrap();
    let (src, a, b) = out[0].as_ref().unwrap().clone().unwrap();
    assert_eq!((src, a, b), (1, vec![1; 3], vec![2; 3]));
}
