//! Tests of `oxcomm::rendezvous`: store ops on both stores, deadlines, authentication both
//! ways, hostile connections, and environment discovery.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use oxcomm::rendezvous::env::{EnvInfo, EnvSource, Settings, TransportChoice};
use oxcomm::rendezvous::{generate_token, InMemoryStore, PrefixStore, Store, StoreClient, StoreServer, MAX_KEY_LEN};
use oxcomm::ErrorKind;
use sha2::Sha256;

const TOKEN: &[u8] = b"test token";

fn secs(s: f64) -> Instant {
    Instant::now() + Duration::from_secs_f64(s)
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn server() -> StoreServer {
    StoreServer::bind(loopback(), TOKEN).unwrap()
}

fn client(server: &StoreServer) -> StoreClient {
    StoreClient::connect(server.local_addr(), TOKEN, secs(5.0)).unwrap()
}

/// Every op, with the semantics both stores share.
fn exercise_ops(store: &dyn Store) {
    store.set("a", b"1").unwrap();
    assert_eq!(store.get("a", secs(1.0)).unwrap(), b"1");
    assert_eq!(store.try_get("a").unwrap(), Some(b"1".to_vec()));
    assert_eq!(store.try_get("missing").unwrap(), None);
    store.set("a", b"").unwrap();
    assert_eq!(store.try_get("a").unwrap(), Some(vec![]));
    store.wait(&["a"], secs(1.0)).unwrap();
    store.wait(&[], secs(1.0)).unwrap();

    assert_eq!(store.add("n", 5).unwrap(), 5);
    assert_eq!(store.add("n", -7).unwrap(), -2);
    assert_eq!(store.get("n", secs(1.0)).unwrap(), b"-2");
    store.set("text", b"hello").unwrap();
    assert_eq!(store.add("text", 1).unwrap_err().kind(), ErrorKind::InvalidArgument);
    store.set("big", i64::MAX.to_string().as_bytes()).unwrap();
    assert_eq!(store.add("big", 1).unwrap_err().kind(), ErrorKind::InvalidArgument);

    assert!(store.delete("a").unwrap());
    assert!(!store.delete("a").unwrap());
    assert_eq!(store.try_get("a").unwrap(), None);

    // compare_set: absent → set; mismatch → current value; match → new.
    assert_eq!(store.compare_set("c", None, b"x").unwrap(), b"x");
    assert_eq!(store.compare_set("c", None, b"y").unwrap(), b"x");
    assert_eq!(store.compare_set("c", Some(b"z"), b"y").unwrap(), b"x");
    assert_eq!(store.compare_set("c", Some(b"x"), b"y").unwrap(), b"y");
    assert_eq!(store.compare_set("absent", Some(b"x"), b"y").unwrap(), b"");
    assert_eq!(store.try_get("absent").unwrap(), None);

    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    assert_eq!(store.set(&long_key, b"v").unwrap_err().kind(), ErrorKind::InvalidArgument);
    let value = vec![7u8; 1 << 20];
    store.set("one MiB", &value).unwrap();
    assert_eq!(store.get("one MiB", secs(1.0)).unwrap(), value);

    let prefixed = PrefixStore::new("group1", store);
    prefixed.set("k", b"v").unwrap();
    assert_eq!(store.try_get("group1/k").unwrap(), Some(b"v".to_vec()));
    prefixed.wait(&["k"], secs(1.0)).unwrap();
}

#[test]
fn in_memory_store_ops() {
    exercise_ops(&InMemoryStore::new());
}

#[test]
fn tcp_store_ops_and_binds_only_the_given_address() {
    let server = server();
    let addr = server.local_addr();
    assert!(addr.ip().is_loopback(), "bound {addr}");
    assert_ne!(addr.port(), 0);
    exercise_ops(&client(&server));
}

#[test]
fn get_waits_for_a_later_set_on_both_stores() {
    let server = server();
    let stores: Vec<(Arc<dyn Store>, Arc<dyn Store>)> = vec![
        {
            let s = InMemoryStore::new();
            (Arc::new(s.clone()), Arc::new(s))
        },
        (Arc::new(client(&server)), Arc::new(client(&server))),
    ];
    for (reader, writer) in stores {
        let setter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            writer.set("late", b"here").unwrap();
            writer.set("late2", b"too").unwrap();
        });
        let start = Instant::now();
        assert_eq!(reader.get("late", secs(2.0)).unwrap(), b"here");
        reader.wait(&["late", "late2"], secs(2.0)).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(40));
        setter.join().unwrap();
    }
}

#[test]
fn waits_time_out_at_their_deadline() {
    let server = server();
    let tcp = client(&server);
    let memory = InMemoryStore::new();
    for store in [&tcp as &dyn Store, &memory] {
        let start = Instant::now();
        let err = store.wait(&["never", "nor this"], secs(0.15)).unwrap_err();
        let waited = start.elapsed();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        assert!(err.message().contains("\"never\""), "{err}");
        assert!(waited >= Duration::from_millis(150), "{waited:?}");
        assert!(waited < Duration::from_secs(2), "{waited:?}");

        let err = store.get("never", Instant::now()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
        // A timed-out wait leaves the store usable.
        store.set("after", b"ok").unwrap();
        assert_eq!(store.try_get("after").unwrap(), Some(b"ok".to_vec()));
    }
}

#[test]
fn concurrent_add_from_8_threads() {
    let server = server();
    let shared = Arc::new(client(&server));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let own = client(&server);
            let shared = Arc::clone(&shared);
            thread::spawn(move || {
                for _ in 0..50 {
                    own.add("counter", 1).unwrap();
                    shared.add("counter", 2).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(shared.add("counter", 0).unwrap(), 8 * 50 * 3);

    let memory = InMemoryStore::new();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let m = memory.clone();
            thread::spawn(move || {
                for _ in 0..100 {
                    m.add("c", 1).unwrap();
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(memory.add("c", 0).unwrap(), 800);
}

#[test]
fn client_refuses_a_store_with_another_token() {
    let server = server();
    let err = StoreClient::connect(server.local_addr(), b"wrong", secs(5.0)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rendezvous, "{err}");
    assert!(err.message().contains("OXCOMM_TOKEN"), "{err}");
    // The server keeps serving the right clients.
    client(&server).set("k", b"v").unwrap();
}

// --- Raw protocol helpers (the wire format documented in `rendezvous::store`). ---

fn frame(code: u8, fields: &[&[u8]]) -> Vec<u8> {
    let mut out = b"OXST".to_vec();
    out.push(1);
    out.push(code);
    out.extend_from_slice(&(fields.len() as u16).to_le_bytes());
    for f in fields {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

/// Reads one frame: (code, fields).
fn read_frame(s: &mut TcpStream) -> (u8, Vec<Vec<u8>>) {
    let mut header = [0u8; 8];
    s.read_exact(&mut header).unwrap();
    assert_eq!(&header[..5], b"OXST\x01");
    let count = u16::from_le_bytes([header[6], header[7]]);
    let fields = (0..count)
        .map(|_| {
            let mut len = [0u8; 4];
            s.read_exact(&mut len).unwrap();
            let mut f = vec![0u8; u32::from_le_bytes(len) as usize];
            s.read_exact(&mut f).unwrap();
            f
        })
        .collect();
    (header[5], fields)
}

/// Runs the client side of the handshake by hand; `proof_token` signs the proof.
fn raw_handshake(addr: SocketAddr, proof_token: &[u8]) -> (TcpStream, u8) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let client_nonce = [9u8; 32];
    s.write_all(&frame(0x01, &[&client_nonce])).unwrap();
    let (code, fields) = read_frame(&mut s);
    assert_eq!(code, 0x02);
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(proof_token).unwrap();
    mac.update(&fields[0]);
    mac.update(&client_nonce);
    mac.update(b"oxcomm-store-v1/client");
    let proof = mac.finalize().into_bytes();
    s.write_all(&frame(0x03, &[&proof])).unwrap();
    let (code, _) = read_frame(&mut s);
    (s, code)
}

/// True when the server closed `s` (EOF or reset) within the stream's read timeout.
fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted)
            }
        }
    }
}

#[test]
fn server_rejects_a_client_with_another_token() {
    let server = server();
    let (mut s, code) = raw_handshake(server.local_addr(), b"wrong");
    assert_eq!(code, 0x05, "expected REJECT");
    assert!(closed_by_server(&mut s));
    let (mut good, code) = raw_handshake(server.local_addr(), TOKEN);
    assert_eq!(code, 0x04, "expected WELCOME");
    good.write_all(&frame(0x10, &[b"k", b"v"])).unwrap();
    assert_eq!(read_frame(&mut good).0, 0x20);
}

#[test]
fn hostile_connections_do_not_stop_a_good_client() {
    let server = StoreServer::builder(TOKEN)
        .handshake_timeout(Duration::from_millis(200))
        .frame_timeout(Duration::from_millis(300))
        .bind(loopback())
        .unwrap();
    let addr = server.local_addr();
    let timeout = Some(Duration::from_secs(3));

    // Half a HELLO, then silence: holds its own thread only, dropped after 200 ms.
    let silent_since = Instant::now();
    let mut silent = TcpStream::connect(addr).unwrap();
    silent.set_read_timeout(timeout).unwrap();
    silent.write_all(&frame(0x01, &[&[0u8; 32]])[..10]).unwrap();

    // Garbage instead of a HELLO.
    let mut garbage = TcpStream::connect(addr).unwrap();
    garbage.set_read_timeout(timeout).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();

    // An authenticated client announcing a 4 GiB key.
    let (mut oversized, code) = raw_handshake(addr, TOKEN);
    assert_eq!(code, 0x04);
    let mut header = frame(0x10, &[]);
    header[6..8].copy_from_slice(&2u16.to_le_bytes());
    header.extend_from_slice(&u32::MAX.to_le_bytes());
    oversized.write_all(&header).unwrap();

    // An authenticated client that starts a request and stops half way: dropped after the
    // frame timeout (300 ms here).
    let (mut stalled, code) = raw_handshake(addr, TOKEN);
    assert_eq!(code, 0x04);
    stalled.write_all(&frame(0x10, &[b"key", b"value"])[..13]).unwrap();

    // Meanwhile a good client works.
    let good = client(&server);
    good.set("k", b"v").unwrap();
    assert_eq!(good.get("k", secs(1.0)).unwrap(), b"v");
    assert_eq!(good.add("n", 1).unwrap(), 1);

    assert!(closed_by_server(&mut garbage), "garbage connection not dropped");
    assert!(closed_by_server(&mut oversized), "oversized frame not dropped");
    assert!(closed_by_server(&mut silent), "silent connection not dropped");
    let waited = silent_since.elapsed();
    assert!(waited >= Duration::from_millis(200), "{waited:?}");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    assert!(closed_by_server(&mut stalled), "stalled frame not dropped");

    // Still serving after all that.
    assert_eq!(good.add("n", 1).unwrap(), 2);
    assert_eq!(client(&server).try_get("k").unwrap(), Some(b"v".to_vec()));
}

#[test]
fn connect_retries_until_the_server_starts() {
    // Find a free port, release it, and start the server there a little later.
    let addr = TcpListener::bind(loopback()).unwrap().local_addr().unwrap();
    let starter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(150));
        StoreServer::bind(addr, TOKEN).unwrap()
    });
    let c = StoreClient::connect(addr, TOKEN, secs(3.0)).unwrap();
    c.set("k", b"v").unwrap();
    let server = starter.join().unwrap();
    assert_eq!(server.local_addr(), addr);
}

#[test]
fn connect_times_out_when_nobody_listens() {
    let addr = TcpListener::bind(loopback()).unwrap().local_addr().unwrap();
    let start = Instant::now();
    let err = StoreClient::connect(addr, TOKEN, secs(0.2)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(start.elapsed() >= Duration::from_millis(190));
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn shutdown_ends_pending_waits_with_peer_gone() {
    let server = server();
    let c = client(&server);
    let waiter = thread::spawn(move || {
        let start = Instant::now();
        (c.get("never", secs(5.0)), start.elapsed())
    });
    thread::sleep(Duration::from_millis(100));
    server.shutdown();
    let (result, waited) = waiter.join().unwrap();
    let err = result.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PeerGone, "{err}");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    server.shutdown(); // idempotent
}

#[test]
fn tokens_are_fresh_hex() {
    let t = generate_token();
    assert_eq!(t.len(), 64);
    assert!(t.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_ne!(t, generate_token());
}

// --- Environment discovery ---

fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |name| map.get(name).cloned()
}

fn discover(vars: &[(&str, &str)]) -> oxcomm::Result<EnvInfo> {
    EnvInfo::from_lookup(env(vars))
}

/// The error for `vars` must be Rendezvous and mention every string in `needles`.
fn assert_env_error(vars: &[(&str, &str)], needles: &[&str]) {
    let err = discover(vars).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rendezvous, "{err}");
    for needle in needles {
        assert!(err.message().contains(needle), "{err:?} lacks {needle:?}");
    }
}

#[test]
fn env_reads_each_source() {
    let info = discover(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ])
    .unwrap();
    assert_eq!(
        info,
        EnvInfo {
            rank: 3,
            world_size: 8,
            local_rank: 1,
            local_world_size: 2,
            master_addr: Some("node0".into()),
            master_port: Some(29500),
            source: EnvSource::Torchrun,
        }
    );

    let ompi = discover(&[
        ("OMPI_COMM_WORLD_RANK", "5"),
        ("OMPI_COMM_WORLD_SIZE", "6"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
    ])
    .unwrap();
    assert_eq!(
        (ompi.rank, ompi.world_size, ompi.local_rank, ompi.local_world_size, ompi.source),
        (5, 6, 2, 3, EnvSource::OpenMpi)
    );
    assert_eq!((ompi.master_addr, ompi.master_port), (None, None));

    let pmi =
        discover(&[("PMI_RANK", "1"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "4")]).unwrap();
    assert_eq!((pmi.rank, pmi.local_world_size, pmi.source), (1, 4, EnvSource::Pmi));

    let ours = discover(&[
        ("OXCOMM_RANK", "0"),
        ("OXCOMM_WORLD_SIZE", "2"),
        ("OXCOMM_LOCAL_RANK", "0"),
        ("OXCOMM_LOCAL_WORLD_SIZE", "2"),
    ])
    .unwrap();
    assert_eq!(ours.source, EnvSource::Oxcomm);
}

#[test]
fn env_reads_slurm_layouts() {
    let slurm = |extra: &[(&'static str, &'static str)]| {
        let mut vars = vec![("SLURM_PROCID", "6"), ("SLURM_NTASKS", "7"), ("SLURM_LOCALID", "0")];
        vars.extend_from_slice(extra);
        discover(&vars)
    };
    // "2(x3),1": nodes 0..3 run 2 tasks, node 3 runs 1.
    let info = slurm(&[("SLURM_TASKS_PER_NODE", "2(x3),1"), ("SLURM_NODEID", "3")]).unwrap();
    assert_eq!((info.local_world_size, info.source), (1, EnvSource::Slurm));
    let info = slurm(&[("SLURM_TASKS_PER_NODE", "2(x3),1"), ("SLURM_NODEID", "1")]).unwrap();
    assert_eq!(info.local_world_size, 2);
    let info = slurm(&[("SLURM_TASKS_PER_NODE", "4(x2)")]).unwrap();
    assert_eq!(info.local_world_size, 4);
    let info = slurm(&[("SLURM_NTASKS_PER_NODE", "3")]).unwrap();
    assert_eq!(info.local_world_size, 3);

    assert!(slurm(&[("SLURM_TASKS_PER_NODE", "2(x3),1")]).unwrap_err().message().contains("SLURM_NODEID"));
    let err = slurm(&[("SLURM_TASKS_PER_NODE", "2(3)")]).unwrap_err();
    assert!(err.message().contains("SLURM_TASKS_PER_NODE=\"2(3)\""), "{err}");
    let err = slurm(&[("SLURM_TASKS_PER_NODE", "2(x3),1"), ("SLURM_NODEID", "4")]).unwrap_err();
    assert!(err.message().contains("SLURM_NODEID=4"), "{err}");
}

#[test]
fn env_precedence_and_nested_launches() {
    let torch_and_ompi = |ompi_rank: &'static str, ompi_size: &'static str| {
        discover(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", ompi_rank),
            ("OMPI_COMM_WORLD_SIZE", ompi_size),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS_PER_NODE", "1"),
        ])
    };
    // Same job described twice, consistently: torchrun wins.
    let info = torch_and_ompi("3", "4").unwrap();
    assert_eq!((info.source, info.rank, info.local_world_size), (EnvSource::Torchrun, 3, 2));
    // torchrun started once per node by mpirun (a smaller world): torchrun wins.
    let info = torch_and_ompi("1", "2").unwrap();
    assert_eq!((info.source, info.rank), (EnvSource::Torchrun, 3));
    // Same world size, different rank: a contradiction naming both variables.
    assert_env_error_fn(torch_and_ompi("2", "4"), &["RANK=3", "OMPI_COMM_WORLD_RANK=2"]);

    // Open MPI over PMI over Slurm.
    let info = discover(&[
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "2"),
        ("MPI_LOCALRANKID", "0"),
        ("MPI_LOCALNRANKS", "1"),
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ])
    .unwrap();
    assert_eq!((info.source, info.local_world_size), (EnvSource::OpenMpi, 2));
}

fn assert_env_error_fn(result: oxcomm::Result<EnvInfo>, needles: &[&str]) {
    let err = result.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rendezvous, "{err}");
    for needle in needles {
        assert!(err.message().contains(needle), "{err:?} lacks {needle:?}");
    }
}

#[test]
fn env_errors_name_the_variable() {
    let torch = [("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v = torch.to_vec();
        v.extend_from_slice(extra);
        v
    };
    assert_env_error(&with(&[("RANK", "0")]), &["WORLD_SIZE", "RANK"]);
    assert_env_error(&[("RANK", "0"), ("WORLD_SIZE", "1")], &["LOCAL_RANK"]);
    assert_env_error(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")], &["LOCAL_WORLD_SIZE"]);
    assert_env_error(&with(&[("RANK", "x1"), ("WORLD_SIZE", "1")]), &["RANK=\"x1\""]);
    assert_env_error(&with(&[("RANK", "0"), ("WORLD_SIZE", "-1")]), &["WORLD_SIZE=\"-1\""]);
    assert_env_error(&with(&[("RANK", "0"), ("WORLD_SIZE", "0")]), &["WORLD_SIZE=0"]);
    assert_env_error(&with(&[("RANK", "4"), ("WORLD_SIZE", "4")]), &["RANK=4", "WORLD_SIZE=4"]);
    assert_env_error(
        &[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")],
        &["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"],
    );
    assert_env_error(
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "3")],
        &["LOCAL_WORLD_SIZE=3", "WORLD_SIZE=2"],
    );
    assert_env_error(
        &with(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "99999")]),
        &["MASTER_PORT=\"99999\""],
    );
    assert_env_error(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")], &["OMPI_COMM_WORLD_LOCAL_RANK"]);
    assert_env_error(&[], &["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]);
}

#[test]
fn settings_read_their_variables() {
    let s = Settings::from_lookup(env(&[])).unwrap();
    assert_eq!(s, Settings::default());
    assert_eq!(s.timeout, Duration::from_secs(300));
    assert_eq!(s.transport, TransportChoice::Auto);

    let token = generate_token();
    let s = Settings::from_lookup(env(&[
        ("OXCOMM_TOKEN", &token),
        ("OXCOMM_TIMEOUT", "2.5"),
        ("OXCOMM_SOCKET_IFNAME", "eth0"),
        ("OXCOMM_SOCKET_ADDR", "10.1.2.3"),
        ("OXCOMM_TRANSPORT", "TCP"),
    ]))
    .unwrap();
    assert_eq!(s.token.as_deref().map(<[u8]>::len), Some(32));
    assert_eq!(s.timeout, Duration::from_millis(2500));
    assert_eq!(s.socket_ifname.as_deref(), Some("eth0"));
    assert_eq!(s.socket_addr, Some("10.1.2.3".parse().unwrap()));
    assert_eq!(s.transport, TransportChoice::Tcp);
    assert!(!format!("{s:?}").contains(&token[..8]), "Debug leaks the token");

    let raw = Settings::from_lookup(env(&[("OXCOMM_TOKEN", "not hex!")])).unwrap();
    assert_eq!(raw.token.as_deref(), Some(&b"not hex!"[..]));

    for (var, value) in [
        ("OXCOMM_TIMEOUT", "0"),
        ("OXCOMM_TIMEOUT", "soon"),
        ("OXCOMM_SOCKET_ADDR", "eth0"),
        ("OXCOMM_TRANSPORT", "rdma"),
    ] {
        let err = Settings::from_lookup(env(&[(var, value)])).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Rendezvous);
        assert!(err.message().contains(&format!("{var}={value:?}")), "{err}");
    }
}
