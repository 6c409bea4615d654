//! A cluster's network, as meshpilot decides it (the system namespace's `topology.istio.io/network`
//! label, else the MeshNetworks network whose endpoints come `fromRegistry` the cluster), and
//! whether the two sources agree.

use crate::model::MeshNetworks;

use super::report::Check;

const NAME: &str = "network";

/// What the cluster's system namespace says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SystemNamespace {
    Missing,
    Present { network: Option<String> },
}

/// The cluster's network, as endpoint conversion takes it (`registry::convert`).
pub fn network_of(
    id: &str,
    label: Option<&str>,
    networks: Option<&MeshNetworks>,
) -> Option<String> {
    label
        .map(str::to_string)
        .or_else(|| networks?.network_of_registry(id).map(str::to_string))
}

/// Networks whose endpoints MeshNetworks says come `fromRegistry` this cluster.
fn registered(id: &str, networks: &MeshNetworks) -> Vec<String> {
    networks
        .networks
        .iter()
        .filter(|(_, spec)| {
            spec.endpoints
                .iter()
                .any(|e| e.from_registry.as_deref() == Some(id))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// Whether the label and MeshNetworks agree on the cluster's network.
pub fn consistency(
    id: &str,
    namespace: &str,
    system: &SystemNamespace,
    networks: Option<&MeshNetworks>,
) -> Check {
    let label = match system {
        SystemNamespace::Missing => {
            return Check::warn(
                NAME,
                format!("namespace {namespace} does not exist: no network label, and the control plane's objects have nowhere to go"),
            )
        }
        SystemNamespace::Present { network } => network.as_deref(),
    };
    let registered = networks.map(|n| registered(id, n)).unwrap_or_default();
    match (label, registered.as_slice()) {
        (None, []) => Check::ok(
            NAME,
            format!("no topology.istio.io/network label on namespace {namespace} and no meshNetworks entry: the default network"),
        ),
        (None, [one]) => Check::ok(NAME, format!("{one} (meshNetworks fromRegistry: {id})")),
        (None, [first, ..]) => Check::warn(
            NAME,
            format!(
                "meshNetworks puts registry {id} on several networks ({}); meshpilot uses the first, {first}",
                registered.join(", ")
            ),
        ),
        (Some(label), []) if networks.is_some() => Check::warn(
            NAME,
            format!("{label} (label on namespace {namespace}), but no meshNetworks network has fromRegistry: {id}, so its registryServiceName gateways are not looked up here"),
        ),
        (Some(label), []) => Check::ok(NAME, format!("{label} (label on namespace {namespace})")),
        (Some(label), _) if registered.iter().any(|r| r == label) => Check::ok(
            NAME,
            format!("{label} (label on namespace {namespace}, meshNetworks agrees)"),
        ),
        (Some(label), _) => Check::fail(
            NAME,
            format!(
                "namespace {namespace} is labelled network {label}, but meshNetworks puts registry {id} on {}: gateways and endpoints would disagree on where this cluster is",
                registered.join(", ")
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    const NETWORKS: &str = "
networks:
  net1: {endpoints: [{fromRegistry: east}], gateways: [{address: 192.0.2.1, port: 15443}]}
  net2: {endpoints: [{fromRegistry: west}, {fromRegistry: north}]}
  net3: {endpoints: [{fromRegistry: north}]}
";

    fn labelled(network: Option<&str>) -> SystemNamespace {
        SystemNamespace::Present {
            network: network.map(str::to_string),
        }
    }

    #[test]
    fn label_and_mesh_networks_must_agree() {
        let n = MeshNetworks::parse(NETWORKS).unwrap();
        let status = |id: &str, label: Option<&str>| {
            consistency(id, "istio-system", &labelled(label), Some(&n)).status
        };
        assert_eq!(status("east", Some("net1")), Status::Ok);
        assert_eq!(status("east", None), Status::Ok);
        let mismatch = consistency("east", "istio-system", &labelled(Some("net2")), Some(&n));
        assert_eq!(mismatch.status, Status::Fail);
        assert!(
            mismatch.message.contains("labelled network net2")
                && mismatch.message.contains("registry east on net1"),
            "{}",
            mismatch.message
        );
        assert_eq!(status("north", Some("net3")), Status::Ok);
        assert_eq!(status("north", None), Status::Warn);
        assert_eq!(status("south", Some("net9")), Status::Warn);
        assert_eq!(status("south", None), Status::Ok);
        assert_eq!(
            consistency("south", "istio-system", &labelled(Some("net9")), None).status,
            Status::Ok
        );
        assert_eq!(
            consistency("south", "istio-system", &SystemNamespace::Missing, None).status,
            Status::Warn
        );
    }

    #[test]
    fn the_label_wins_over_mesh_networks() {
        let n = MeshNetworks::parse(NETWORKS).unwrap();
        assert_eq!(
            network_of("east", Some("x"), Some(&n)).as_deref(),
            Some("x")
        );
        assert_eq!(network_of("east", None, Some(&n)).as_deref(), Some("net1"));
        assert_eq!(network_of("east", None, None), None);
    }
}
