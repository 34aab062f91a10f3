//! The exit barrier of multi-node jobs: node 0's launcher keeps the rendezvous store up until
//! the other nodes' launchers report that their ranks are done, as torchrun does. Single-node
//! jobs never get here.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use oxcomm::rendezvous::{Store, StoreClient, StoreServer};
use oxcomm::ErrorKind;
use signal_hook::consts::{SIGINT, SIGTERM};

use super::plan::{resolve, LaunchPlan};
use super::supervise::{Event, Stop, POLL_INTERVAL};

/// Multi-node: how long node 0's launcher keeps serving the store, after its own ranks all
/// succeeded, for the other nodes' launchers to report that their ranks finished (torchrun's
/// exit barrier has the same default).
const EXIT_BARRIER_TIMEOUT: Duration = Duration::from_secs(300);

/// Multi-node: how long a launcher on another node tries to report to node 0's store that its
/// ranks finished.
const EXIT_REPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// After this long in the exit barrier, node 0's launcher says what it is waiting for.
const EXIT_BARRIER_NOTICE: Duration = Duration::from_secs(2);

/// Multi-node jobs only: keeps node 0's store up until every node's ranks are done, so ranks
/// on a slower node can still use it after node 0's ranks exit. Each launcher of nodes 1..K
/// sets `oxcomm-launch/{job id}/exit/{node}` once its ranks have exited; node 0's launcher,
/// when its own ranks all succeeded, waits for those keys (at most
/// [`EXIT_BARRIER_TIMEOUT`]). When node 0's ranks failed or it was interrupted, it closes the
/// store at once, which tells the ranks elsewhere that the job is over.
pub(super) struct ExitBarrier<'a> {
    pub(super) plan: &'a LaunchPlan,
    pub(super) token: &'a [u8],
    pub(super) master_addr: &'a str,
    pub(super) master_port: u16,
}

impl ExitBarrier<'_> {
    fn key(&self, node: usize) -> String {
        format!("oxcomm-launch/{}/exit/{node}", self.plan.job_id)
    }

    /// Returns the signal that interrupted the wait, if one did.
    pub(super) fn run(
        &self,
        server: Option<&StoreServer>,
        stop: Option<Stop>,
        rx: &mpsc::Receiver<Event>,
    ) -> Option<i32> {
        match server {
            None => {
                self.report();
                None
            }
            Some(_) if stop.is_some() => None,
            Some(server) => self.wait(server, rx),
        }
    }

    /// On nodes 1..K: tells node 0 this node's ranks are done. Failing to reach it is fine:
    /// node 0's launcher has then already gone.
    fn report(&self) {
        let deadline = Instant::now() + EXIT_REPORT_TIMEOUT;
        let Ok(addr) = resolve(self.master_addr, self.master_port) else { return };
        if let Ok(client) = StoreClient::connect(addr, self.token, deadline) {
            let _ = client.with_op_timeout(EXIT_REPORT_TIMEOUT).set(&self.key(self.plan.node_rank), b"done");
        }
    }

    /// On node 0: waits for every other node's report, a signal, or the timeout.
    fn wait(&self, server: &StoreServer, rx: &mpsc::Receiver<Event>) -> Option<i32> {
        let start = Instant::now();
        let deadline = start + EXIT_BARRIER_TIMEOUT;
        let local = server.local_addr();
        let addr = match local.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), local.port()),
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(std::net::Ipv6Addr::LOCALHOST.into(), local.port())
            }
            _ => local,
        };
        let client = match StoreClient::connect(addr, self.token, start + EXIT_REPORT_TIMEOUT) {
            Ok(client) => client,
            Err(err) => {
                eprintln!("oxcomm launch: cannot wait for the other nodes: {err}");
                return None;
            }
        };
        let keys: Vec<String> = (1..self.plan.nnodes).map(|node| self.key(node)).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut told = false;
        loop {
            let now = Instant::now();
            match client.wait(&key_refs, deadline.min(now + POLL_INTERVAL)) {
                Ok(()) => return None,
                Err(err) if err.kind() == ErrorKind::Timeout => {}
                Err(err) => {
                    eprintln!("oxcomm launch: cannot wait for the other nodes: {err}");
                    return None;
                }
            }
            if Instant::now() >= deadline {
                eprintln!(
                    "oxcomm launch: gave up after {}s waiting for the other nodes' ranks to finish",
                    EXIT_BARRIER_TIMEOUT.as_secs()
                );
                return None;
            }
            if !told && start.elapsed() >= EXIT_BARRIER_NOTICE {
                eprintln!(
                    "oxcomm launch: this node's ranks are done; serving the store until the other nodes' \
                     ranks finish (at most {}s)",
                    EXIT_BARRIER_TIMEOUT.as_secs()
                );
                told = true;
            }
            while let Ok(event) = rx.try_recv() {
                if let Event::Signal(signal @ (SIGINT | SIGTERM)) = event {
                    return Some(signal);
                }
            }
        }
    }
}
