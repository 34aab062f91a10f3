//! A panic inside an op (issue 16, item 6): the rank's op fails with the panic's message, the
//! communicator aborts, pending `Work` handles complete with that error, later ops fail at
//! once, and the peers' ops fail naming the panicking rank. The panic comes from a
//! [`Link`] written by the application (wrapping the in-process links), which ops call while
//! they hold the communicator's turn and links.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxcomm::transport::inproc::mesh;
use oxcomm::transport::{Doorbell, Link};
use oxcomm::{CommConfig, Communicator, ErrorKind, ReduceOp, Result};

/// A link that panics on its next send once armed.
struct PanickingLink {
    inner: Box<dyn Link>,
    armed: Arc<AtomicBool>,
}

impl Link for PanickingLink {
    fn peer(&self) -> usize {
        self.inner.peer()
    }
    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        if self.armed.load(Ordering::SeqCst) {
            panic!("injected panic in a user link");
        }
        self.inner.try_send(data)
    }
    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.inner.try_recv(buf)
    }
    fn peek(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.inner.peek(buf)
    }
    fn check_peer(&mut self) -> Result<()> {
        self.inner.check_peer()
    }
    fn close(&mut self, cause: Option<(usize, ErrorKind)>) {
        self.inner.close(cause)
    }
    fn kind(&self) -> oxcomm::Transport {
        oxcomm::Transport::Threads
    }
}

/// `n` thread-rank communicators whose rank-0 links panic once `armed` is set. The op
/// deadline (30 s) is far above every bound checked.
fn communicators(n: usize, armed: &Arc<AtomicBool>) -> Vec<Communicator> {
    let config = CommConfig { timeout: Duration::from_secs(30), ..CommConfig::default() };
    mesh(n)
        .into_iter()
        .map(|ep| {
            let links = ep
                .links
                .into_iter()
                .map(|l| {
                    l.map(|l| {
                        let inner = Box::new(l) as Box<dyn Link>;
                        if ep.rank == 0 {
                            Box::new(PanickingLink { inner, armed: armed.clone() }) as Box<dyn Link>
                        } else {
                            inner
                        }
                    })
                })
                .collect();
            let bell: Arc<dyn Doorbell> = ep.doorbell;
            Communicator::from_links(ep.rank, links, bell, config.clone(), oxcomm::Transport::Threads).unwrap()
        })
        .collect()
}

/// Every peer's op fails within 2 s naming rank 0.
fn peers_name_rank_0(results: Vec<(Result<()>, Duration)>) {
    for (r, (res, took)) in results.into_iter().enumerate() {
        let e = res.expect_err("the peer's op must fail");
        assert_eq!(e.peer(), Some(0), "rank {}: {e}", r + 1);
        // "rank 0 is gone (it aborted after failing)", or a neighbour's "rank 1 aborted: it lost rank 0".
        assert!(e.to_string().contains("aborted"), "rank {}: {e}", r + 1);
        assert!(took < Duration::from_secs(2), "rank {} took {took:?}: {e}", r + 1);
    }
}

#[test]
fn issue16_a_panic_in_a_sync_op_aborts_and_peers_see_it() {
    let armed = Arc::new(AtomicBool::new(false));
    let comms = communicators(3, &armed);
    std::thread::scope(|s| {
        let mut it = comms.into_iter();
        let c0 = it.next().unwrap();
        let peers: Vec<_> = it
            .map(|c| {
                s.spawn(move || {
                    let mut b = vec![1.0f32; 64];
                    c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
                    let t = Instant::now();
                    let r = c.all_reduce(&mut b, ReduceOp::Sum);
                    (r, t.elapsed())
                })
            })
            .collect();
        let mut b = vec![1.0f32; 64];
        c0.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        armed.store(true, Ordering::SeqCst);
        let e = c0.all_reduce(&mut b, ReduceOp::Sum).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");
        assert!(e.to_string().contains("panicked") && e.to_string().contains("injected panic"), "{e}");
        // Later ops fail at once with the cause.
        let t = Instant::now();
        let later = c0.barrier().unwrap_err();
        assert!(t.elapsed() < Duration::from_millis(250), "{:?}", t.elapsed());
        assert!(later.to_string().contains("injected panic"), "{later}");
        assert!(c0.abort_cause().is_some());
        peers_name_rank_0(peers.into_iter().map(|h| h.join().unwrap()).collect());
    });
}

#[test]
fn issue16_a_panic_on_the_async_worker_completes_every_pending_handle() {
    let armed = Arc::new(AtomicBool::new(false));
    let comms = communicators(2, &armed);
    std::thread::scope(|s| {
        let mut it = comms.into_iter();
        let c0 = it.next().unwrap();
        let c1 = it.next().unwrap();
        let peer = s.spawn(move || {
            c1.barrier().unwrap();
            let t = Instant::now();
            let r = c1.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum);
            (r, t.elapsed())
        });
        c0.barrier().unwrap();
        armed.store(true, Ordering::SeqCst);
        let t = Instant::now();
        // The first panics on the worker; the ones queued behind it must not wait their turn.
        let first = c0.all_reduce_async(vec![1.0f32; 8], ReduceOp::Sum);
        let second = c0.all_gather_async(vec![1.0f32; 8]);
        let third = c0.barrier_async();
        let e1 = first.wait().unwrap_err();
        assert_eq!(e1.kind(), ErrorKind::Aborted, "{e1}");
        assert!(e1.to_string().contains("injected panic"), "{e1}");
        for e in [second.wait().unwrap_err(), third.wait().unwrap_err()] {
            assert_eq!(e.kind(), ErrorKind::Aborted, "{e}");
            assert!(e.to_string().contains("injected panic"), "{e}");
        }
        // A sync op issued after them fails at once too.
        let later = c0.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).unwrap_err();
        assert!(later.to_string().contains("injected panic"), "{later}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        peers_name_rank_0(vec![peer.join().unwrap()]);
    });
}
