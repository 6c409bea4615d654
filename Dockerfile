# meshpilot's image: built from source in a Rust stage, run as a non-root user from a distroless
# base (glibc, CA certificates, nothing else). `docker build -t meshpilot:0.1.0 .`, then push it
# and render the manifests with `--set image=<registry>/meshpilot:0.1.0`.
FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
# Declared in Cargo.toml (a bench target and a workspace member), so they must be present.
COPY benches benches
COPY tests/apiserver tests/apiserver
RUN cargo build --release --locked --bin meshpilot

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/meshpilot /usr/local/bin/meshpilot
# The uid the manifests' securityContext runs it as.
USER 1337:1337
EXPOSE 15010 15012 15014 15017
ENTRYPOINT ["/usr/local/bin/meshpilot"]
CMD ["discovery"]
