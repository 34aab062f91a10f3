//! Dissemination barrier: in round k rank r signals r + 2^k and waits for r − 2^k; after
//! ⌈log2 n⌉ rounds every rank has (transitively) heard from every other. Each signal is the
//! op's 48-byte fingerprint, checked on receipt. Steps: ⌈log2 n⌉; bytes sent per rank:
//! 48 · ⌈log2 n⌉.
//!
//! The default barrier is the agreement phase itself ([`super::star::agree`]), which also
//! names ranks that never arrive; this one is selectable with [`super::Algorithm::Dissemination`].

use super::schedule;
use crate::engine::Ctx;
use crate::error::{Error, ErrorKind, Result};
use crate::wire::{Fingerprint, FP_BYTES};

/// Runs the dissemination barrier for `mine`.
pub(crate) fn dissemination(ctx: &mut Ctx<'_>, mine: &Fingerprint) -> Result<()> {
    // It talks over links, so it meets ranks that may run the op another way (module docs).
    let r = ctx.watched(mine, |ctx| rounds(ctx, mine));
    r.map_err(|e| ctx.blame_the_dead(e))
}

/// The rounds of [`dissemination`].
fn rounds(ctx: &mut Ctx<'_>, mine: &Fingerprint) -> Result<()> {
    let out = mine.encode();
    for round in 0..schedule::dissemination_rounds(ctx.size) {
        let (to, from) = schedule::dissemination(ctx.rank, ctx.size, round);
        let mut got = [0u8; FP_BYTES];
        ctx.sendrecv(to, &out, from, &mut got)?;
        let theirs = Fingerprint::decode_from(&got, ctx.world(from))?;
        if theirs != *mine {
            let who = ctx.world(from);
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!("ranks called different collectives: rank {who} called {theirs}, this rank called {mine}"),
            )
            .with_peer(who));
        }
    }
    Ok(())
}
