//! The hidden `oxcomm store-ping`: a rank-side check, run as a rank of `oxcomm launch`, that
//! the launcher's store is reachable with the environment the launcher gave (see
//! [`StorePingArgs`]).

use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use oxcomm::init::{ENV_JOB_ID, ENV_STORE, STORE_LAUNCHER};
use oxcomm::rendezvous::env::{MASTER_ADDR, MASTER_PORT, OXCOMM_TOKEN};
use oxcomm::rendezvous::{EnvInfo, PrefixStore, Settings, Store, StoreClient};

use super::args::StorePingArgs;
use super::plan::resolve;

/// Runs the hidden `oxcomm store-ping` (see [`StorePingArgs`]); returns the exit status.
pub fn store_ping(args: StorePingArgs) -> anyhow::Result<i32> {
    let info = EnvInfo::from_env().context("store-ping must run as a rank of `oxcomm launch`")?;
    let settings = Settings::from_env()?;
    if std::env::var(ENV_STORE).ok().as_deref() != Some(STORE_LAUNCHER) {
        bail!("{ENV_STORE} is not {STORE_LAUNCHER:?}: no launcher serves the store");
    }
    let (Some(host), Some(port)) = (info.master_addr.as_deref(), info.master_port) else {
        bail!("{MASTER_ADDR} and {MASTER_PORT} must be set");
    };
    let token = settings.token.ok_or_else(|| anyhow!("{OXCOMM_TOKEN} is not set"))?;
    let job = std::env::var(ENV_JOB_ID).with_context(|| format!("{ENV_JOB_ID} is not set"))?;
    let deadline = Instant::now() + args.timeout;
    let addr = resolve(host, port)?;
    let client = StoreClient::connect(addr, &token, deadline)
        .with_context(|| format!("cannot connect to the store at {addr}"))?;
    let store = PrefixStore::new(format!("store-ping/{job}"), &client);
    store.set(&format!("rank/{}", info.rank), info.rank.to_string().as_bytes())?;
    store.add("count", 1)?;
    let keys: Vec<String> = (0..info.world_size).map(|r| format!("rank/{r}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&key_refs, deadline).context("waiting for the other ranks")?;
    for (r, key) in keys.iter().enumerate() {
        let value = store.get(key, deadline)?;
        if value != r.to_string().as_bytes() {
            bail!("store key {key} holds {:?}, not {r}", String::from_utf8_lossy(&value));
        }
    }
    println!("store-ping: rank {} of {} ok, job {job}", info.rank, info.world_size);
    Ok(0)
}
