//! Building the mesh: every pair of ranks connected once, through the rendezvous store
//! ([`connect_mesh`]), and choosing the address a rank listens on ([`choose_bind_ip`]).

#[allow(clippy::wildcard_imports)]
use super::*;

/// The store key under which rank `rank` of `job` publishes its TCP address.
pub fn address_key(job: &str, rank: usize) -> String {
    format!("tcp/{job}/addr/{rank}")
}

/// Builds this rank's TCP links to every other rank of `world` through `store`: listens on
/// `bind_ip`, publishes the address under [`address_key`], reads every peer's, connects and
/// hands out the parts, all before `deadline`. Uses the default [`TcpConfig`].
#[allow(clippy::type_complexity)]
pub fn connect_mesh(
    store: &dyn Store,
    rank: usize,
    world: usize,
    bind_ip: IpAddr,
    token: &[u8],
    job: &str,
    deadline: Instant,
) -> Result<(Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>)> {
    connect_mesh_with(store, rank, world, bind_ip, token, job, &TcpConfig::default(), deadline)
}

/// [`connect_mesh`] with given settings.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn connect_mesh_with(
    store: &dyn Store,
    rank: usize,
    world: usize,
    bind_ip: IpAddr,
    token: &[u8],
    job: &str,
    config: &TcpConfig,
    deadline: Instant,
) -> Result<(Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>)> {
    let peers: Vec<usize> = (0..world).filter(|&p| p != rank).collect();
    let (links, bell) = connect_peers_with(store, rank, world, &peers, bind_ip, token, job, config, deadline)?;
    let links = links.into_iter().map(|l| l.map(|l| Box::new(l) as Box<dyn Link>)).collect();
    Ok((links, bell))
}

/// [`connect_mesh_with`] to the listed `peers` only (e.g. the ranks on other hosts, when
/// peers on this host use shared memory); every rank that lists this one must be listed
/// here. Returns the links indexed by world rank (`None` for unlisted ranks) and the doorbell
/// with their concrete types.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn connect_peers_with(
    store: &dyn Store,
    rank: usize,
    world: usize,
    peers: &[usize],
    bind_ip: IpAddr,
    token: &[u8],
    job: &str,
    config: &TcpConfig,
    deadline: Instant,
) -> Result<(Vec<Option<TcpLink>>, Arc<TcpDoorbell>)> {
    if bind_ip.is_unspecified() {
        return Err(Error::invalid(format!(
            "cannot publish the unspecified address {bind_ip} for peers to connect to; bind a real address \
             (see choose_bind_ip)"
        ))
        .with_rank(rank));
    }
    let mut ep = TcpEndpoint::listen_with(bind_ip, rank, world, token, job, config)?;
    store.set(&address_key(job, rank), ep.local_addr().to_string().as_bytes()).map_err(|e| e.with_rank(rank))?;
    let mut addrs = Vec::with_capacity(peers.len());
    for &p in peers {
        let raw = store.get(&address_key(job, p), deadline).map_err(|e| e.with_peer(p).with_rank(rank))?;
        let addr = std::str::from_utf8(&raw)
            .ok()
            .filter(|s| s.len() <= 128)
            .and_then(|s| s.parse::<SocketAddr>().ok())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Rendezvous,
                    format!("rank {p} published a TCP address that does not parse ({} bytes)", raw.len()),
                )
                .with_peer(p)
                .with_rank(rank)
            })?;
        addrs.push((p, addr));
    }
    // Every address was published after its listener was up, so a refused connection means
    // that rank has exited; and a rank whose peer failed elsewhere hears of it from the store.
    ep.connect_published(&addrs, deadline, &|| store.check_job())?;
    Ok(ep.into_tcp_parts())
}

/// Picks the IP address this rank binds and advertises: `addr` if given; else the first IPv4
/// address (or, lacking one, IPv6) of interface `ifname`; else the address the OS would send
/// from to reach the store at `store_addr` (a UDP socket "connected" to it; no packet is
/// sent). The choice is logged at `info` on target `oxcomm::tcp`.
pub fn choose_bind_ip(store_addr: SocketAddr, ifname: Option<&str>, addr: Option<IpAddr>) -> Result<IpAddr> {
    if let Some(ip) = addr {
        tracing::info!(target: "oxcomm::tcp", %ip, "binding the address given explicitly");
        return Ok(ip);
    }
    if let Some(name) = ifname {
        let ifs = if_addrs::get_if_addrs()
            .map_err(|e| Error::io("listing the network interfaces", e).with_op("choosing the TCP address"))?;
        let on_if: Vec<IpAddr> = ifs.iter().filter(|i| i.name == name).map(|i| i.ip()).collect();
        let pick = on_if.iter().find(|ip| ip.is_ipv4()).or_else(|| on_if.first()).copied();
        return match pick {
            Some(ip) => {
                tracing::info!(target: "oxcomm::tcp", %ip, interface = name, "binding the interface's address");
                Ok(ip)
            }
            None => {
                let mut names: Vec<&str> = ifs.iter().map(|i| i.name.as_str()).collect();
                names.sort_unstable();
                names.dedup();
                Err(Error::new(
                    ErrorKind::Rendezvous,
                    format!("network interface {name:?} has no IP address or does not exist (interfaces: {names:?})"),
                ))
            }
        };
    }
    let any: SocketAddr =
        if store_addr.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (IpAddr::from([0u16; 8]), 0).into() };
    let ip = UdpSocket::bind(any)
        .and_then(|s| s.connect(store_addr).map(|()| s))
        .and_then(|s| s.local_addr())
        .map(|a| a.ip())
        .map_err(|e| Error::io(format!("finding the local address that routes to the store at {store_addr}"), e))?;
    tracing::info!(target: "oxcomm::tcp", %ip, store = %store_addr, "binding the address that routes to the store");
    Ok(ip)
}
