//! Identity and leadership: the Lease election, the CA (its keys from a directory, the config
//! cluster or the state directory; a self-signed root kept rotated), callers' authentication, the
//! serving certificate, the trust bundle sent to proxies, and the work only the leader does (root
//! ConfigMaps, webhook caBundles).

use std::sync::Arc;

use tracing::info;

use super::inputs::ConfigCluster;
use super::StartError;
use crate::aggregate::Aggregate;
use crate::config::DiscoveryArgs;
use crate::install::gateway_deployment;
use crate::kube_client::ClusterClients;
use crate::leader::{self, HeldLocks, Leader, LeaderConfig, LockKind};
use crate::metrics::Metrics;
use crate::model::ClusterId;
use crate::security::authn::Authenticator;
use crate::security::ca::{CertificateAuthority, TtlPolicy};
use crate::security::keys::{self, KeySource};
use crate::security::node_auth::{NodeAuthorizer, PodDirectory, PodFacts};
use crate::security::rotation::{self, SharedCa};
use crate::security::tls::ServingCert;
use crate::security::trust;
use crate::sources::revision_tags::RevisionTags;
use crate::sources::trust_bundle::{self, TrustBundleOptions};
use crate::sources::{allocation_status, gateway_status, ingress};
use crate::supervise::Supervisor;
use crate::webhook::ca_bundle;

/// With a Kubernetes config cluster: the election deciding who does the one-replica work.
pub(super) fn leader(
    args: &DiscoveryArgs,
    config_cluster: Option<&ConfigCluster>,
    supervisor: &mut Supervisor,
) -> Option<Leader> {
    let mut leader = Leader::start(
        config_cluster?.client.clone(),
        lock_config(
            args,
            args.inject.revision.suffixed(leader::LEASE_NAME),
            LockKind::Lease,
        ),
    );
    leader.supervise(supervisor);
    Some(leader)
}

/// This replica competing for one lock in the system namespace.
fn lock_config(args: &DiscoveryArgs, name: String, lock: LockKind) -> LeaderConfig {
    LeaderConfig {
        namespace: args.system_namespace.clone(),
        name,
        identity: (args.leader_identity.clone()).unwrap_or_else(leader::default_identity),
        lease_duration: args.leader_election_lease_duration,
        lock,
    }
}

/// The CA, from the first key source given; a self-signed root is kept rotated.
pub(super) async fn ca(
    args: &DiscoveryArgs,
    config_cluster: Option<&ConfigCluster>,
    leader: Option<&Leader>,
    metrics: &Metrics,
    supervisor: &mut Supervisor,
) -> Result<Arc<SharedCa>, StartError> {
    let key_source = match (&args.ca_dir, config_cluster) {
        (Some(dir), _) => KeySource::Dir(dir.clone()),
        (None, Some(c)) => KeySource::Kubernetes {
            client: c.client.clone(),
            namespace: args.system_namespace.clone(),
            leading: leader.map(Leader::leading),
        },
        (None, None) => {
            let dir = args.ca_state_dir().ok_or(StartError::NoStateDir)?;
            info!(dir = %dir.display(), "CA state directory");
            KeySource::StateDir(dir)
        }
    };
    let loaded = keys::load(key_source, &args.trust_domain, args.self_signed_root_ttl).await?;
    let ttl = TtlPolicy {
        default: args.workload_cert_ttl,
        max: args.max_workload_cert_ttl,
    };
    let ca = CertificateAuthority::new(&loaded.bundle, ttl).map_err(|source| StartError::Ca {
        origin: loaded.origin,
        source,
    })?;
    let ca = SharedCa::new(ca);
    if let Some(store) = loaded.self_signed {
        supervisor.adopt(
            "root rotation",
            rotation::keep_rotated(
                ca.clone(),
                store,
                loaded.bundle,
                args.root_rotation(),
                metrics.ca(),
            ),
        );
    }
    Ok(ca)
}

/// Who a caller is: its client certificate, else its token reviewed by its cluster.
/// With `--multiroot-mesh`: the trust bundle proxies are sent over PCDS, kept current.
pub(super) fn trust_bundle(
    args: &DiscoveryArgs,
    aggregate: &Arc<Aggregate>,
    ca: &Arc<SharedCa>,
    supervisor: &mut Supervisor,
) {
    if !args.multiroot_mesh {
        return;
    }
    let options = TrustBundleOptions {
        refresh: args.spiffe_bundle_refresh_interval,
        timeout: args.spiffe_bundle_fetch_timeout,
    };
    let task = trust_bundle::start(aggregate.clone(), ca.roots(), options);
    supervisor.adopt("trust bundle", task);
}

pub(super) fn authenticator(
    args: &DiscoveryArgs,
    config_cluster: Option<&ConfigCluster>,
) -> Arc<Authenticator> {
    Arc::new(Authenticator::new(
        &args.trust_domain,
        cluster_clients(config_cluster),
    ))
}

/// The API servers meshpilot may ask about callers: the config cluster's and the remotes'.
pub(super) fn cluster_clients(config_cluster: Option<&ConfigCluster>) -> ClusterClients {
    ClusterClients::new(
        config_cluster.map(|c| (c.id.clone(), c.client.clone())),
        config_cluster.map(|c| c.remotes.clients()),
    )
}

/// Who may ask for other identities' certificates: trusted node accounts, for pods on their node,
/// as the clusters' registries know them.
pub(super) fn node_authorizer(args: &DiscoveryArgs, aggregate: &Arc<Aggregate>) -> NodeAuthorizer {
    NodeAuthorizer::new(
        args.ca_trusted_node_accounts.0.clone(),
        Arc::new(ClusterPods(aggregate.clone())),
        &args.trust_domain,
    )
}

/// The pods of every cluster's registry, for the node authorizer.
struct ClusterPods(Arc<Aggregate>);

impl PodDirectory for ClusterPods {
    fn pod(&self, cluster: &str, namespace: &str, name: &str) -> Option<PodFacts> {
        let registry = self.0.cluster(&ClusterId::new(cluster))?;
        registry.with_pod(namespace, name, |pod| PodFacts {
            uid: pod.uid.as_deref().map(str::to_string),
            service_account: pod.service_account.to_string(),
            node: pod.node.as_deref().map(str::to_string),
        })
    }

    fn runs_on_node(&self, cluster: &str, namespace: &str, account: &str, node: &str) -> bool {
        let registry = self.0.cluster(&ClusterId::new(cluster));
        registry.is_some_and(|r| r.runs_on_node(namespace, account, node))
    }
}

/// The certificate of the secure xDS and webhook servers, kept renewed.
pub(super) fn serving_cert(
    args: &DiscoveryArgs,
    ca: &Arc<SharedCa>,
    supervisor: &mut Supervisor,
) -> Result<Arc<ServingCert>, StartError> {
    let names = args.serving_names();
    let serving = ServingCert::issue(&ca.current(), &names, args.serving_cert_ttl)?;
    supervisor.adopt(
        "serving certificate renewal",
        serving.keep_renewed(ca.clone(), names, args.serving_cert_ttl),
    );
    Ok(serving)
}

/// While leading our Lease: the webhooks' caBundles kept current; and, each while also holding
/// istiod's lock for it, the root published in every namespace's `istio-ca-root-cert`,
/// allocated addresses recorded in ServiceEntries' status and served Ingresses' status written
/// (cluster-wide ConfigMap locks, which the default tag's revision takes over), the Gateway API's
/// status written and its managed
/// Gateways deployed (per-revision Leases), for the objects this revision owns and no running
/// istiod claims (`sources::gateway_owners`).
pub(super) fn leader_work(
    args: &DiscoveryArgs,
    config_cluster: Option<&ConfigCluster>,
    leader: Option<&Leader>,
    ca: &SharedCa,
    aggregate: &Arc<Aggregate>,
    (held, supervisor): (&HeldLocks, &mut Supervisor),
) {
    let (Some(c), Some(leader)) = (config_cluster, leader) else {
        return;
    };
    let (client, id, remotes) = (c.client.clone(), c.id.clone(), c.remotes.clients());
    let served_ingresses = c.ingress.served();
    let mesh = aggregate.mesh().clone();
    let clusters = aggregate.clone();
    let discovered_of: trust::DiscoveredOf =
        Arc::new(move |id| clusters.cluster(id).map(|c| c.discovered().clone()));
    let namespace = args.system_namespace.clone();
    let revision = args.inject.revision.clone();
    let roots = ca.roots();
    let handover = args.gateway_handover_delay;
    let inject = args.inject.config(
        &args.cluster_id,
        &args.system_namespace,
        &args.domain_suffix,
        mesh.snapshot().config.mesh().clone(),
    );
    let args = args.clone();
    let held = held.clone();
    supervisor.adopt(
        "leader work",
        leader::run_while_leading(leader.leading(), move || {
            let (tags, mut work) =
                RevisionTags::watch(client.clone(), &namespace, revision.clone());
            let cluster_wide = |name: &str| {
                let lock = LockKind::ConfigMap {
                    revision: revision.clone(),
                    preferred: tags.default_tag(),
                };
                lock_config(&args, name.to_string(), lock)
            };
            let per_revision =
                |name: &str| lock_config(&args, format!("{name}-{revision}"), LockKind::Lease);
            work.extend(ca_bundle::keep_current(
                client.clone(),
                id.clone(),
                remotes.clone(),
                (namespace.clone(), revision.clone()),
                roots.clone(),
            ));
            let publish = {
                let (client, id, remotes) = (client.clone(), id.clone(), remotes.clone());
                let (discovered_of, namespace, roots) =
                    (discovered_of.clone(), namespace.clone(), roots.clone());
                move || {
                    trust::publish_root(
                        (client.clone(), id.clone()),
                        remotes.clone(),
                        discovered_of.clone(),
                        namespace.clone(),
                        roots.clone(),
                    )
                }
            };
            let lock = cluster_wide(leader::NAMESPACE_CONTROLLER);
            work.push(leader::while_holding(client.clone(), lock, &held, publish));
            let allocate = {
                let (client, id, mesh) = (client.clone(), id.clone(), mesh.clone());
                move || {
                    vec![allocation_status::keep(
                        client.clone(),
                        id.clone(),
                        mesh.clone(),
                    )]
                }
            };
            let lock = cluster_wide(leader::IP_AUTOALLOCATE);
            work.push(leader::while_holding(client.clone(), lock, &held, allocate));
            let ingress_status = {
                let (client, served, tags) =
                    (client.clone(), served_ingresses.clone(), tags.clone());
                let revision = revision.clone();
                move || {
                    let keep = ingress::status::keep(
                        client.clone(),
                        served.clone(),
                        revision.clone(),
                        tags.clone(),
                    );
                    vec![keep]
                }
            };
            let lock = cluster_wide(leader::INGRESS_CONTROLLER);
            work.push(leader::while_holding(
                client.clone(),
                lock,
                &held,
                ingress_status,
            ));
            let status = {
                let (client, id, mesh, tags) =
                    (client.clone(), id.clone(), mesh.clone(), tags.clone());
                let revision = revision.clone();
                move || {
                    let keep = gateway_status::keep(
                        client.clone(),
                        id.clone(),
                        mesh.clone(),
                        revision.clone(),
                        (tags.clone(), handover),
                    );
                    vec![keep]
                }
            };
            let lock = per_revision(leader::GATEWAY_STATUS);
            work.push(leader::while_holding(client.clone(), lock, &held, status));
            let deploy = {
                let (client, id, mesh, tags) =
                    (client.clone(), id.clone(), mesh.clone(), tags.clone());
                let inject = inject.clone();
                move || {
                    let keep = gateway_deployment::keep(
                        client.clone(),
                        id.clone(),
                        mesh.clone(),
                        inject.clone(),
                        (tags.clone(), handover),
                    );
                    vec![keep]
                }
            };
            let lock = per_revision(leader::GATEWAY_DEPLOYMENT);
            work.push(leader::while_holding(client.clone(), lock, &held, deploy));
            work
        }),
    );
}
