//! East-west gateways whose MeshNetworks `address` is a DNS name: resolved, and resolved again
//! every 30 s, each change re-deriving the gateways. istiod does the same with
//! `RESOLVE_HOSTNAME_GATEWAYS` (on by default): it re-resolves at the records' TTL, never sooner
//! than 30 s (`MinGatewayTTL`, pilot/pkg/model/network.go). A name that fails to resolve keeps
//! the addresses it last had, so a DNS outage does not cut a network off (istiod drops them).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{info, warn};

use crate::aggregate::Aggregate;
use crate::model::GatewayNames;

/// How often names are resolved again.
const REFRESH: Duration = Duration::from_secs(30);
/// How long one lookup may take.
const LOOKUP_DEADLINE: Duration = Duration::from_secs(5);

/// Resolves the names `names` holds, now, whenever they change and every [`REFRESH`]; runs
/// until the process ends.
pub async fn resolve(aggregate: Arc<Aggregate>, mut names: watch::Receiver<BTreeSet<String>>) {
    let mut resolved = GatewayNames::default();
    loop {
        let wanted = names.borrow_and_update().clone();
        let mut next = BTreeMap::new();
        for name in &wanted {
            match lookup(name).await {
                Ok(addresses) => {
                    next.insert(name.clone(), addresses);
                }
                Err(e) => {
                    warn!(gateway = %name, error = %e, "could not resolve a gateway's address; keeping the last it had");
                    if let Some(last) = resolved.0.get(name) {
                        next.insert(name.clone(), last.clone());
                    }
                }
            }
        }
        let next = GatewayNames(next);
        if next != resolved {
            info!(names = ?next.0, "gateway addresses resolved");
            resolved = next.clone();
            if aggregate.mesh().write(|mesh| mesh.set_gateway_names(next)) {
                aggregate.refresh_gateways();
            }
        }
        let refresh = async {
            match wanted.is_empty() {
                true => std::future::pending().await,
                false => tokio::time::sleep(REFRESH).await,
            }
        };
        tokio::select! {
            changed = names.changed() => if changed.is_err() {
                // The sources are gone: the process is ending.
                std::future::pending::<()>().await;
            },
            () = refresh => {}
        }
    }
}

/// The name's addresses (A and AAAA), sorted; an error when there are none.
async fn lookup(name: &str) -> Result<Vec<IpAddr>, String> {
    let lookup = tokio::net::lookup_host((name, 0));
    let found = match tokio::time::timeout(LOOKUP_DEADLINE, lookup).await {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err(format!("no answer within {LOOKUP_DEADLINE:?}")),
    };
    let mut addresses: Vec<IpAddr> = found.map(|a| a.ip()).collect();
    addresses.sort();
    addresses.dedup();
    match addresses.is_empty() {
        true => Err("no addresses".into()),
        false => Ok(addresses),
    }
}
