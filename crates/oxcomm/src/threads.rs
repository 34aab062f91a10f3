//! Ranks as threads of one process: [`run`] starts n ranks, each with its own
//! [`Communicator`] over in-process links, and returns what each rank's closure returned.
//! Used by tests, examples and `oxcomm bench --transport threads`.

use std::sync::Arc;

use crate::comm::{CommConfig, Communicator};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::inproc::mesh;
use crate::transport::{Doorbell, Link};

/// Runs `f` on `n` thread ranks with the default [`CommConfig`]; returns each rank's result
/// in rank order. A rank that panics makes this return an error naming it (after every
/// other rank has finished or failed: a panicking rank's links close, so peers do not hang).
pub fn run<R, F>(n: usize, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(Communicator) -> R + Sync,
{
    run_with(n, CommConfig::default(), f)
}

/// [`run`] with a given configuration.
pub fn run_with<R, F>(n: usize, config: CommConfig, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(Communicator) -> R + Sync,
{
    spawn_ranks(communicators(n, config)?, f)
}

/// Runs `f` on one thread per communicator; see [`run`].
fn spawn_ranks<R, F>(comms: Vec<Communicator>, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(Communicator) -> R + Sync,
{
    let n = comms.len();
    if n == 0 {
        return Err(Error::invalid("threads::run needs at least one rank"));
    }
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                std::thread::Builder::new()
                    .name(format!("oxcomm-rank-{r}"))
                    .spawn_scoped(s, move || f(c))
                    .map_err(|e| Error::io(format!("spawning rank {r}"), e))
            })
            .collect::<Result<_>>()?;
        let mut out = Vec::with_capacity(n);
        let mut panicked = None;
        for (r, h) in handles.into_iter().enumerate() {
            match h.join() {
                Ok(v) => out.push(v),
                Err(p) => {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    panicked.get_or_insert(
                        Error::new(ErrorKind::Aborted, format!("rank {r} panicked: {msg}")).with_rank(r),
                    );
                }
            }
        }
        match panicked {
            Some(e) => Err(e),
            None => Ok(out),
        }
    })
}

/// [`run_with`] on `hosts.len()` thread ranks that behave as if rank `r` were on host
/// `hosts[r]` (any labels): the links are still in-process, but groups that span these
/// "hosts" evenly run the hierarchical algorithms, as a multi-host job would. For tests and
/// benchmarks of the algorithms without a network.
pub fn run_on_hosts<R, F, L>(hosts: &[L], config: CommConfig, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(Communicator) -> R + Sync,
    L: PartialEq + Sync,
{
    let comms = communicators(hosts.len(), config)?.into_iter().map(|c| c.with_hosts(hosts)).collect::<Result<_>>()?;
    spawn_ranks(comms, f)
}

/// Builds `n` connected world communicators over in-process links, without starting threads.
pub fn communicators(n: usize, config: CommConfig) -> Result<Vec<Communicator>> {
    mesh(n)
        .into_iter()
        .map(|ep| {
            let links: Vec<Option<Box<dyn Link>>> =
                ep.links.into_iter().map(|l| l.map(|l| Box::new(l) as Box<dyn Link>)).collect();
            let bell: Arc<dyn Doorbell> = ep.doorbell;
            Communicator::from_links(ep.rank, links, bell, config.clone(), crate::transport::Transport::Threads)
        })
        .collect()
}
