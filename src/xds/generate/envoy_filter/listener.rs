//! Patches to a listener, in istiod's stages (`ApplyListenerPatches`,
//! pilot/pkg/networking/core/envoyfilter/listener_patch.go): the listener, its listener filters,
//! its filter chains, their network filters, then the HTTP filters (and inline routes) of their
//! connection managers. Within a filter list, ADD/INSERT/REPLACE/REMOVE run first, then MERGE.

use envoy_types::pb::envoy::config::core::v3::{address, socket_address, Address};
use envoy_types::pb::envoy::config::listener::v3::{
    filter, Filter, FilterChain, Listener, ListenerFilter,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::RouteSpecifier, http_filter, HttpConnectionManager, HttpFilter,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::util::pack_any;
use prost::Message;

use super::ops::{merge_into, ListPatch};
use super::route::{self, Names};
use super::{PatchRef, ProxyPatches};
use crate::istio::envoy_filter::{
    ApplyTo, ListenerMatch, Operation, PatchContext, HTTP_CONNECTION_MANAGER,
};
use crate::xds::generate::names::{VIRTUAL_INBOUND, VIRTUAL_OUTBOUND};

const TCP_PROXY: &str = "envoy.filters.network.tcp_proxy";
const ROUTER: &str = "envoy.filters.http.router";

/// What of the listener its patches match on, read before its chains change.
struct View {
    name: String,
    port: u32,
    /// `virtualInbound`/`virtualOutbound`: ports are matched per chain (its destination port).
    virtual_listener: bool,
}

/// Applies the proxy's patches to `listener`; false when a patch removes it.
pub(super) fn patch(
    patches: &ProxyPatches,
    context: PatchContext,
    listener: &mut Listener,
) -> bool {
    let view = &View {
        name: listener.name.clone(),
        port: port_of(listener.address.as_ref()),
        virtual_listener: listener.name == VIRTUAL_INBOUND || listener.name == VIRTUAL_OUTBOUND,
    };
    let applies = |target| {
        patches
            .of(target)
            .filter(move |p| p.in_context(context) && listener_matches(p, view, target))
    };
    for p in applies(ApplyTo::Listener) {
        match p.operation() {
            Operation::Remove => return false,
            op if op.merges() => {
                merge_into(&p, listener, &view.name);
            }
            _ => {}
        }
    }
    for p in applies(ApplyTo::ListenerFilter) {
        let wanted = listener_match(&p).map_or("", |m| m.listener_filter.as_str());
        let selects = |f: &ListenerFilter| f.name == wanted;
        if p.operation().merges() {
            for f in listener.listener_filters.iter_mut() {
                if wanted.is_empty() || f.name == wanted {
                    merge_into(&p, f, &view.name);
                }
            }
        } else {
            ListPatch {
                patch: p,
                selects: (!wanted.is_empty())
                    .then_some(&selects as &dyn Fn(&ListenerFilter) -> bool),
                terminal: &|_| false,
            }
            .apply(&mut listener.listener_filters);
        }
    }
    let chains = std::mem::take(&mut listener.filter_chains);
    let mut kept: Vec<FilterChain> = chains
        .into_iter()
        .filter_map(|mut chain| {
            let kept = patch_chain(patches, context, view, &mut chain);
            // A chain left without filters goes, as istiod drops them (Envoy needs some).
            (kept && !chain.filters.is_empty()).then_some(chain)
        })
        .collect();
    if let Some(mut chain) = listener.default_filter_chain.take() {
        if patch_chain(patches, context, view, &mut chain) && !chain.filters.is_empty() {
            listener.default_filter_chain = Some(chain);
        }
    }
    for p in applies(ApplyTo::FilterChain).filter(|p| p.operation() == Operation::Add) {
        kept.extend(p.typed::<FilterChain>());
    }
    listener.filter_chains = kept;
    true
}

/// One chain's patches: the chain's own, its network filters', its HTTP filters'. False when a
/// patch removes it.
fn patch_chain(
    patches: &ProxyPatches,
    context: PatchContext,
    view: &View,
    chain: &mut FilterChain,
) -> bool {
    // The chain as generated: what its patches match, before they change it.
    let (name, chain_match) = (chain.name.clone(), chain.filter_chain_match.clone());
    let generated = (name.as_str(), chain_match.as_ref());
    let applies = |target| {
        patches.of(target).filter(move |p| {
            p.in_context(context)
                && listener_matches(p, view, target)
                && chain_matches(p, view, generated)
        })
    };
    // The chain's own patches see the chain as generated; collected before it changes.
    let own: Vec<PatchRef<'_>> = applies(ApplyTo::FilterChain).collect();
    let network: Vec<PatchRef<'_>> = applies(ApplyTo::NetworkFilter).collect();
    let http: Vec<PatchRef<'_>> = applies(ApplyTo::HttpFilter).collect();
    let routes = [
        ApplyTo::RouteConfiguration,
        ApplyTo::VirtualHost,
        ApplyTo::HttpRoute,
    ]
    .into_iter()
    .any(|t| patches.of(t).any(|p| p.in_context(context)));
    for p in &own {
        match p.operation() {
            Operation::Remove => return false,
            op if op.merges() => {
                merge_into(p, chain, &view.name);
            }
            _ => {}
        }
    }
    patch_network_filters(&network, &mut chain.filters, &view.name);
    if !http.is_empty() || routes {
        for f in chain
            .filters
            .iter_mut()
            .filter(|f| f.name == HTTP_CONNECTION_MANAGER)
        {
            let http: Vec<PatchRef<'_>> = http
                .iter()
                .filter(|p| filter_name(p).is_none_or(|n| n == HTTP_CONNECTION_MANAGER))
                .copied()
                .collect();
            patch_connection_manager(patches, context, &http, f, &view.name);
        }
    }
    true
}

fn patch_network_filters(patches: &[PatchRef<'_>], filters: &mut Vec<Filter>, resource: &str) {
    let terminal = |f: &Filter| f.name == HTTP_CONNECTION_MANAGER || f.name == TCP_PROXY;
    for p in patches.iter().filter(|p| !p.operation().merges()) {
        let wanted = filter_name(p);
        let selects = |f: &Filter| Some(f.name.as_str()) == wanted;
        ListPatch {
            patch: *p,
            selects: wanted.map(|_| &selects as &dyn Fn(&Filter) -> bool),
            terminal: &terminal,
        }
        .apply(filters);
    }
    for p in patches.iter().filter(|p| p.operation().merges()) {
        let wanted = filter_name(p);
        for f in filters.iter_mut() {
            let config = match &f.config_type {
                Some(filter::ConfigType::TypedConfig(any)) => Some(any),
                _ => None,
            };
            if selected(wanted, &f.name, config, p) {
                merge_into(p, f, resource);
            }
        }
    }
}

/// The HTTP filters (and an inline route configuration) of one connection manager.
fn patch_connection_manager(
    patches: &ProxyPatches,
    context: PatchContext,
    http: &[PatchRef<'_>],
    filter: &mut Filter,
    resource: &str,
) {
    let Some(filter::ConfigType::TypedConfig(any)) = &filter.config_type else {
        return;
    };
    let Ok(mut hcm) = HttpConnectionManager::decode(any.value.as_slice()) else {
        return;
    };
    let terminal = |f: &HttpFilter| f.name == ROUTER;
    for p in http.iter().filter(|p| !p.operation().merges()) {
        let wanted = sub_filter_name(p);
        let selects = |f: &HttpFilter| Some(f.name.as_str()) == wanted;
        ListPatch {
            patch: *p,
            selects: wanted.map(|_| &selects as &dyn Fn(&HttpFilter) -> bool),
            terminal: &terminal,
        }
        .apply(&mut hcm.http_filters);
    }
    for p in http.iter().filter(|p| p.operation().merges()) {
        let wanted = sub_filter_name(p);
        for f in hcm.http_filters.iter_mut() {
            let config = match &f.config_type {
                Some(http_filter::ConfigType::TypedConfig(any)) => Some(any),
                _ => None,
            };
            if selected(wanted, &f.name, config, p) {
                merge_into(p, f, resource);
            }
        }
    }
    if let Some(RouteSpecifier::RouteConfig(config)) = &mut hcm.route_specifier {
        let names = Names::of(&config.name);
        // An inline route configuration a patch removes leaves no routes (Envoy needs some).
        if !route::patch(patches, context, config, &names) {
            config.virtual_hosts.clear();
        }
    }
    filter.config_type = Some(filter::ConfigType::TypedConfig(pack_any(hcm)));
}

/// Whether a MERGE applies to a filter: the one its match names, else every filter whose config is
/// of the patch's type (or every filter, when the patch sets no config).
fn selected(wanted: Option<&str>, name: &str, config: Option<&Any>, p: &PatchRef<'_>) -> bool {
    match wanted {
        Some(wanted) => wanted == name,
        None => {
            let patch_type = p
                .value()
                .and_then(|v| v.get_field_by_name("typed_config"))
                .and_then(|c| {
                    c.as_message()?
                        .get_field_by_name("type_url")?
                        .as_str()
                        .map(str::to_string)
                });
            match patch_type {
                None => true,
                Some(url) => config.is_some_and(|c| c.type_url == url),
            }
        }
    }
}

fn listener_match<'a>(p: &PatchRef<'a>) -> Option<&'a ListenerMatch> {
    p.patch.matches.as_ref()?.listener.as_ref()
}

fn filter_name<'a>(p: &PatchRef<'a>) -> Option<&'a str> {
    let filter = listener_match(p)?.filter_chain.as_ref()?.filter.as_ref()?;
    Some(filter.name.as_str()).filter(|n| !n.is_empty())
}

fn sub_filter_name<'a>(p: &PatchRef<'a>) -> Option<&'a str> {
    let filter = listener_match(p)?.filter_chain.as_ref()?.filter.as_ref()?;
    Some(filter.sub_filter.as_ref()?.name.as_str()).filter(|n| !n.is_empty())
}

/// The listener part of a match: its name and port (a virtual listener's port is its chains').
fn listener_matches(p: &PatchRef<'_>, view: &View, target: ApplyTo) -> bool {
    let Some(m) = listener_match(p) else {
        return true;
    };
    if !m.name.is_empty() && m.name != view.name {
        return false;
    }
    if m.port_number == 0 || (view.virtual_listener && target != ApplyTo::Listener) {
        return true;
    }
    view.port == m.port_number
}

type ChainMatch = envoy_types::pb::envoy::config::listener::v3::FilterChainMatch;

/// The filter chain part of a match, as istiod's `filterChainMatch`.
fn chain_matches(p: &PatchRef<'_>, view: &View, (name, fcm): (&str, Option<&ChainMatch>)) -> bool {
    let Some(m) = listener_match(p) else {
        return true;
    };
    let destination = fcm
        .and_then(|c| c.destination_port.as_ref())
        .map(|p| p.value);
    if view.virtual_listener && m.port_number > 0 && destination != Some(m.port_number) {
        return false;
    }
    let Some(wanted) = &m.filter_chain else {
        return true;
    };
    if !wanted.name.is_empty() && wanted.name != name {
        return false;
    }
    let fields_wanted = !wanted.sni.is_empty()
        || !wanted.transport_protocol.is_empty()
        || !wanted.application_protocols.is_empty()
        || wanted.destination_port != 0;
    let Some(fcm) = fcm else {
        return !fields_wanted;
    };
    (wanted.sni.is_empty() || fcm.server_names.contains(&wanted.sni))
        && (wanted.transport_protocol.is_empty()
            || fcm.transport_protocol == wanted.transport_protocol)
        && (wanted.application_protocols.is_empty()
            || wanted.application_protocols.split(',').all(|a| {
                fcm.application_protocols
                    .iter()
                    .any(|have| have == a.trim())
            }))
        && (wanted.destination_port == 0 || destination == Some(wanted.destination_port))
}

fn port_of(address: Option<&Address>) -> u32 {
    match address.and_then(|a| a.address.as_ref()) {
        Some(address::Address::SocketAddress(s)) => match s.port_specifier {
            Some(socket_address::PortSpecifier::PortValue(port)) => port,
            _ => 0,
        },
        _ => 0,
    }
}
