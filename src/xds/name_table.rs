//! Istio's DNS name table message (`istio.networking.nds.v1.NameTable`), generated from
//! proto/nds.proto: what the NDS generator builds and the resource cache compares.

#![allow(clippy::all)]
tonic::include_proto!("istio.networking.nds.v1");

impl prost::Name for NameTable {
    const NAME: &'static str = "NameTable";
    const PACKAGE: &'static str = "istio.networking.nds.v1";

    fn type_url() -> String {
        super::protocol::NAME_TABLE_TYPE.to_string()
    }
}
