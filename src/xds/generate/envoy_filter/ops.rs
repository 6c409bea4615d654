//! The operations every patch target shares: placing a value in an ordered list (listener,
//! network and HTTP filters; routes), and merging a value into a message — with a filter's
//! `typed_config` merged into the config of the same type (istiod's `MergeAnyWithAny`).

use prost::{Message, Name};
use prost_reflect::{DynamicMessage, Value};

use super::PatchRef;
use crate::envoy_api::{self, ListMerge};
use crate::istio::envoy_filter::Operation;

/// How a list patch found its place.
pub(super) struct ListPatch<'a, T> {
    pub(super) patch: PatchRef<'a>,
    /// Which elements the patch's match selects; None when it names none.
    pub(super) selects: Option<&'a dyn Fn(&T) -> bool>,
    /// The element that must stay last (a terminal filter), before which appended values go.
    pub(super) terminal: &'a dyn Fn(&T) -> bool,
}

impl<T: Message + Default> ListPatch<'_, T> {
    /// Applies an ADD, INSERT_*, REPLACE or REMOVE to `list` (MERGE is per element). Appended
    /// values go before a terminal element, which Envoy requires to be last (istiod appends after
    /// it, and Envoy then refuses the listener). INSERT_FIRST with a match inserts only where
    /// the match finds something.
    pub(super) fn apply(&self, list: &mut Vec<T>) {
        let first = || self.selects.and_then(|s| list.iter().position(s));
        let end = list
            .iter()
            .position(|e| (self.terminal)(e))
            .unwrap_or(list.len());
        let at = match self.patch.operation() {
            Operation::Add => Some(end),
            Operation::InsertFirst => match self.selects {
                None => Some(0),
                Some(_) => first().map(|_| 0),
            },
            Operation::InsertBefore => match self.selects {
                None => Some(0),
                Some(_) => first(),
            },
            Operation::InsertAfter => match self.selects {
                None => Some(end),
                Some(_) => first().map(|i| i + 1),
            },
            Operation::Replace => {
                if let (Some(i), Some(value)) = (first(), self.patch.typed::<T>()) {
                    list[i] = value;
                }
                return;
            }
            Operation::Remove => {
                if let Some(selects) = self.selects {
                    list.retain(|e| !selects(e));
                }
                return;
            }
            _ => return,
        };
        if let (Some(at), Some(value)) = (at, self.patch.typed::<T>()) {
            list.insert(at, value);
        }
    }
}

/// Merges the patch's value into `target`: lists append (or are replaced, for
/// MERGE_AND_REPLACE_LIST); a `typed_config` of the type `target` has merges into it, of another
/// type is an error (as istiod, which fails the patch then).
pub(super) fn merge_into<M: Message + Name + Default>(
    patch: &PatchRef<'_>,
    target: &mut M,
    resource: &str,
) -> bool {
    let Some(value) = patch.value() else {
        return false;
    };
    let lists = match patch.operation() {
        Operation::MergeAndReplaceList => ListMerge::Replace,
        _ => ListMerge::Append,
    };
    match merged(target, value, lists) {
        Ok(result) => {
            *target = result;
            true
        }
        Err(error) => {
            patch.fail(resource, &error);
            false
        }
    }
}

fn merged<M: Message + Name + Default>(
    target: &M,
    value: &DynamicMessage,
    lists: ListMerge,
) -> Result<M, String> {
    let mut dynamic = envoy_api::to_dynamic(target).map_err(|e| e.to_string())?;
    let mut rest = value.clone();
    if let Some(patch_config) = rest.take_field_by_name("typed_config") {
        merge_typed_config(&mut dynamic, &patch_config, lists)?;
    }
    if let Some(Value::Message(socket)) = rest.take_field_by_name("transport_socket") {
        merge_transport_socket(&mut dynamic, socket, lists)?;
    }
    envoy_api::merge(&mut dynamic, &rest, lists);
    envoy_api::to_typed(&dynamic).map_err(|e| e.to_string())
}

/// A filter's `typed_config` merged: payloads of one type merge, as messages of that type.
fn merge_typed_config(
    target: &mut DynamicMessage,
    patch: &Value,
    lists: ListMerge,
) -> Result<(), String> {
    let Value::Message(patch) = patch else {
        return Ok(());
    };
    let (patch_url, patch_bytes) = any_parts(patch);
    let discovered = || "it has no typed_config to merge into (its config is discovered)".into();
    if !target.has_field_by_name("typed_config") {
        return Err(discovered());
    }
    let Some(Value::Message(existing)) = target.get_field_by_name_mut("typed_config") else {
        return Err(discovered());
    };
    let (url, bytes) = any_parts(existing);
    if url != patch_url {
        return Err(format!(
            "typed_config {patch_url} cannot merge into the filter's {url}"
        ));
    }
    let mut inner = envoy_api::unpack(&url, &bytes).map_err(|e| e.to_string())?;
    let patch_inner = envoy_api::unpack(&patch_url, &patch_bytes).map_err(|e| e.to_string())?;
    envoy_api::merge(&mut inner, &patch_inner, lists);
    existing.set_field_by_name("value", Value::Bytes(inner.encode_to_vec().into()));
    Ok(())
}

/// A transport socket merged into the one of its name (for a cluster with
/// `transport_socket_matches`, the first match whose socket has it), its config as a filter's;
/// a socket of another name replaces the target's. istiod applies only the socket of such a patch;
/// meshpilot applies the rest of it too.
fn merge_transport_socket(
    target: &mut DynamicMessage,
    socket: DynamicMessage,
    lists: ListMerge,
) -> Result<(), String> {
    let name = socket
        .get_field_by_name("name")
        .and_then(|n| n.as_str().map(str::to_string))
        .unwrap_or_default();
    let same_name = |s: &DynamicMessage| {
        s.get_field_by_name("name")
            .and_then(|n| n.as_str().map(|n| n == name))
            == Some(true)
    };
    let mut patch_rest = socket.clone();
    let patch_config = patch_rest.take_field_by_name("typed_config");
    let merge_into_socket = |existing: &mut DynamicMessage| -> Result<(), String> {
        if let Some(config) = &patch_config {
            merge_typed_config(existing, config, lists)?;
        }
        envoy_api::merge(existing, &patch_rest, lists);
        Ok(())
    };
    if target.has_field_by_name("transport_socket_matches") {
        let Some(Value::List(matches)) = target.get_field_by_name_mut("transport_socket_matches")
        else {
            return Ok(());
        };
        let found = matches.iter_mut().find_map(|m| match m {
            Value::Message(m) => match m.get_field_by_name_mut("transport_socket") {
                Some(Value::Message(s)) if same_name(s) => Some(s),
                _ => None,
            },
            _ => None,
        });
        return match found {
            Some(existing) => merge_into_socket(existing),
            None => Err(format!(
                "no transport_socket_matches entry has a transport socket named {name:?}"
            )),
        };
    }
    if target.has_field_by_name("transport_socket") {
        if let Some(Value::Message(existing)) = target.get_field_by_name_mut("transport_socket") {
            if same_name(existing) {
                return merge_into_socket(existing);
            }
        }
    }
    target.set_field_by_name("transport_socket", Value::Message(socket));
    Ok(())
}

fn any_parts(any: &DynamicMessage) -> (String, Vec<u8>) {
    let url = any
        .get_field_by_name("type_url")
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let bytes = any
        .get_field_by_name("value")
        .and_then(|v| v.as_bytes().map(|b| b.to_vec()))
        .unwrap_or_default();
    (url, bytes)
}
