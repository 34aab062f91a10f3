//! Building a world communicator on the native backend over ready links: the one place that
//! constructs a [`NativeBackend`] (an entry point, beside `init.rs`, `threads.rs` and
//! `mpi.rs`, which call it or build their own backend).
//!
//! It checks the link table and hands the backend to [`Communicator::from_backend`]; it knows
//! nothing about how the links were made (each transport's endpoint) or how ops run on them
//! (the backend's business).

use std::sync::Arc;

use crate::backend::native::NativeBackend;
use crate::backend::AnyBackend;
use crate::comm::{CommConfig, Communicator};
use crate::error::{Error, Result};
use crate::transport::{Doorbell, Link, Transport};

/// The direct shared-memory workspaces a world communicator may get (shm transport, Linux).
#[cfg(target_os = "linux")]
pub(crate) type DirectWorkspaces = crate::transport::shm::workspace::ShmDirect;
/// The direct shared-memory workspaces a world communicator may get (never, off Linux).
#[cfg(not(target_os = "linux"))]
pub(crate) type DirectWorkspaces = ();

impl Communicator {
    /// Builds a world communicator over ready links. `links[p]` is the link to world rank `p`
    /// (`None` at `rank`); `bell` is this rank's doorbell that those links ring. Transports
    /// and [`crate::threads::run`] call this; applications normally do not.
    pub fn from_links(
        rank: usize,
        links: Vec<Option<Box<dyn Link>>>,
        bell: Arc<dyn Doorbell>,
        config: CommConfig,
        transport: Transport,
    ) -> Result<Communicator> {
        Communicator::from_parts(rank, links, bell, config, transport, None)
    }

    /// [`Communicator::from_links`] plus the shared-memory workspaces for direct collectives.
    pub(crate) fn from_parts(
        rank: usize,
        links: Vec<Option<Box<dyn Link>>>,
        bell: Arc<dyn Doorbell>,
        config: CommConfig,
        transport: Transport,
        direct: Option<DirectWorkspaces>,
    ) -> Result<Communicator> {
        let size = links.len();
        if rank >= size {
            return Err(Error::invalid(format!("rank {rank} out of range for {size} links")));
        }
        for (p, l) in links.iter().enumerate() {
            if l.is_some() == (p == rank) {
                return Err(Error::invalid(format!("link table of rank {rank} is wrong at {p}")));
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = direct;
        let native = NativeBackend::new(
            rank,
            links,
            bell,
            transport,
            #[cfg(target_os = "linux")]
            direct,
        );
        Ok(Communicator::from_backend(rank, size, AnyBackend::Native(native), config))
    }
}
