//! [`HostGroups`]: the two groups qgZ ([`super::qgz`]) runs over, this rank's host and the
//! ranks with its local index on every host. Built with collectives of the public
//! [`Communicator`] API; it owns the rank arithmetic of a uniform host layout.

use super::arg_error;
use crate::comm::Communicator;
use crate::error::{Error, Result};

/// The host layout qgZ needs: this rank's host (the *intra* group, DeepSpeed's `local_i`)
/// and the ranks with the same local index on every host (the *inter* group, `global_j`),
/// spec §3.2.
///
/// Hosts are contiguous runs of `ranks_per_host` ranks of the communicator they were built
/// for: comm rank `ρ = host · ranks_per_host + local`. The intra group has group rank `local`,
/// the inter group has group rank `host`. To use another placement, reorder the communicator
/// first (e.g. with [`Communicator::split`] keys).
#[derive(Debug, Clone)]
pub struct HostGroups {
    pub(super) ranks_per_host: usize,
    pub(super) hosts: usize,
    /// World ranks of the communicator these groups were built for.
    pub(super) parent: Vec<usize>,
    /// This rank in that communicator.
    pub(super) parent_rank: usize,
    pub(super) intra: Communicator,
    pub(super) inter: Communicator,
}

impl HostGroups {
    /// Builds both groups from `comm` with two [`Communicator::split`]s. **Collective**: every
    /// rank of `comm` must call it with the same `ranks_per_host`.
    ///
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) (before communicating)
    /// if `ranks_per_host` is 0 or does not divide `comm.size()` (DeepSpeed leaves the
    /// remainder ranks without a group and fails later, spec §3.2).
    pub fn uniform(comm: &Communicator, ranks_per_host: usize) -> Result<HostGroups> {
        let w = comm.size();
        if ranks_per_host == 0 || w % ranks_per_host != 0 {
            return Err(arg_error(
                comm,
                "HostGroups::uniform",
                format!("{ranks_per_host} ranks per host does not divide the group of {w} ranks"),
            ));
        }
        let (host, local) = (comm.rank() / ranks_per_host, comm.rank() % ranks_per_host);
        let color = |v: usize| {
            u32::try_from(v).map_err(|_| arg_error(comm, "HostGroups::uniform", format!("{v} does not fit a color")))
        };
        let (host_color, local_color) = (color(host)?, color(local)?);
        let missing = || Error::protocol("split returned no group for a rank that passed a color");
        let intra = comm.split(Some(host_color), local as i64)?.ok_or_else(missing)?;
        let inter = comm.split(Some(local_color), host as i64)?.ok_or_else(missing)?;
        HostGroups::from_parts(comm, ranks_per_host, intra, inter)
    }

    /// The host groups of `comm`'s own topology ([`Communicator::host_layout`]: the hosts
    /// that `init` found, or those of [`crate::threads::run_on_hosts`]). **Collective** when it
    /// returns groups. `Ok(None)` when the group does not span hosts evenly (one host, one
    /// rank per host, or uneven hosts): qgZ then runs its one-host form.
    ///
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) (on every rank, before
    /// communicating) if the ranks of a host are not a contiguous run, which
    /// [`HostGroups`] needs: reorder the communicator first with [`Communicator::split`].
    pub fn from_topology(comm: &Communicator) -> Result<Option<HostGroups>> {
        let Some(layout) = comm.host_layout() else { return Ok(None) };
        let k = layout.ranks_per_host();
        let hosts = comm.hosts();
        // Every host holds exactly k ranks, so runs of k ranks on one host are distinct hosts.
        if hosts.iter().enumerate().any(|(r, h)| *h != hosts[r - r % k]) {
            return Err(arg_error(
                comm,
                "HostGroups::from_topology",
                format!("the ranks of each host are not contiguous (hosts of the ranks: {hosts:?}); reorder them with split"),
            ));
        }
        HostGroups::uniform(comm, k).map(Some)
    }

    /// Wraps groups the caller built: `intra` must hold exactly this rank's host (comm ranks
    /// `host · ranks_per_host ..` in order) and `inter` the comm ranks
    /// `local, local + ranks_per_host, …` in order. Not collective; checks only.
    ///
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) if the sizes or
    /// members do not match that layout.
    pub fn from_parts(
        comm: &Communicator,
        ranks_per_host: usize,
        intra: Communicator,
        inter: Communicator,
    ) -> Result<HostGroups> {
        let w = comm.size();
        let what = "HostGroups::from_parts";
        if ranks_per_host == 0 || w % ranks_per_host != 0 {
            return Err(arg_error(
                comm,
                what,
                format!("{ranks_per_host} ranks per host does not divide the group of {w} ranks"),
            ));
        }
        let hosts = w / ranks_per_host;
        let (host, local) = (comm.rank() / ranks_per_host, comm.rank() % ranks_per_host);
        let m = comm.members();
        let want_intra: Vec<usize> = (0..ranks_per_host).map(|d| m[host * ranks_per_host + d]).collect();
        let want_inter: Vec<usize> = (0..hosts).map(|h| m[h * ranks_per_host + local]).collect();
        if intra.members() != want_intra.as_slice() || intra.rank() != local {
            return Err(arg_error(
                comm,
                what,
                format!(
                    "the intra-host group has world ranks {:?}, expected {want_intra:?} (host {host})",
                    intra.members()
                ),
            ));
        }
        if inter.members() != want_inter.as_slice() || inter.rank() != host {
            return Err(arg_error(
                comm,
                what,
                format!(
                    "the inter-host group has world ranks {:?}, expected {want_inter:?} (local index {local})",
                    inter.members()
                ),
            ));
        }
        Ok(HostGroups { ranks_per_host, hosts, parent: m.to_vec(), parent_rank: comm.rank(), intra, inter })
    }

    /// Ranks per host (`dpn`).
    pub fn ranks_per_host(&self) -> usize {
        self.ranks_per_host
    }

    /// Number of hosts (`nodes`).
    pub fn hosts(&self) -> usize {
        self.hosts
    }

    /// This rank's host index.
    pub fn host(&self) -> usize {
        self.parent_rank / self.ranks_per_host
    }

    /// This rank's index on its host.
    pub fn local_rank(&self) -> usize {
        self.parent_rank % self.ranks_per_host
    }

    /// The ranks of this rank's host.
    pub fn intra(&self) -> &Communicator {
        &self.intra
    }

    /// The ranks with this rank's local index, one per host.
    pub fn inter(&self) -> &Communicator {
        &self.inter
    }
}
