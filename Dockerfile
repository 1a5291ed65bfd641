# oqp in a container: the control plane, the data plane and oqpctl in one small image.
#
# Build from the repository root (.dockerignore keeps target/ and secrets out of the context):
#   docker build -t oqp .
# Run the single-box mode (control plane + its in-process data plane):
#   docker run --rm -p 127.0.0.1:11435:11435 -v $PWD/config.yml:/etc/oqp/config.yml:ro oqp
# Run a data plane beside a GPU box instead:
#   docker run --rm --entrypoint oqp-dataplane oqp --control-plane https://cp.lan:50051 --node gpu1
# The size of the result: docker image ls oqp (the binaries are the `dist` profile: no debug
# info; the runtime layer is debian:bookworm-slim plus ca-certificates).

# ---- build -------------------------------------------------------------------------------
FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# protoc is vendored (protoc-bin-vendored): nothing to install.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --profile dist --bins \
      -p oqp-controlplane -p oqp-dataplane -p oqpctl \
 && install -D -m 0755 -t /out \
      target/dist/oqp-controlplane target/dist/oqp-dataplane target/dist/oqpctl

# ---- run ---------------------------------------------------------------------------------
FROM debian:bookworm-slim AS runtime
# ca-certificates: https upstreams (Ollama Cloud) and a TLS control plane. The user has a
# fixed uid and gid (10001): key files on the host are shared with it by group
# (chown :10001, chmod 640), never by making them world-readable.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 oqp \
 && useradd --system --uid 10001 --gid oqp --home-dir /var/lib/oqp --shell /usr/sbin/nologin oqp \
 && install -d -o oqp -g oqp -m 0700 /var/lib/oqp \
 && install -d -m 0755 /etc/oqp
COPY --from=builder /out/ /usr/local/bin/
USER oqp:oqp
WORKDIR /var/lib/oqp
# 11435: the proxy (HTTP); 50051: the control plane (gRPC: data planes and oqpctl).
EXPOSE 11435 50051
# The proxy's /health, probed by oqpctl (the image has no curl). A container running the
# control plane alone (no --with-dataplane) overrides it with `oqpctl health tcp://127.0.0.1:50051`.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["oqpctl", "health", "http://127.0.0.1:11435/health"]
ENTRYPOINT ["oqp-controlplane"]
CMD ["--config", "/etc/oqp/config.yml", "--with-dataplane"]
