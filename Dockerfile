# syntax=docker/dockerfile:1
# Build: docker build -t idemgate .
# Run:   docker run -p 8080:8080 -v "$PWD/idemgate.toml:/etc/idemgate/idemgate.toml:ro" \
#          -v idemgate-data:/var/lib/idemgate idemgate
# The mounted configuration must listen on 0.0.0.0 to be reachable from
# outside the container, and keep admin_listen on 127.0.0.1:9901 for the
# HEALTHCHECK (or change both).

FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY examples ./examples
RUN cargo build --release --locked --bin idemgate

FROM debian:bookworm-slim
# ca-certificates follows the security updates of the release: not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/idemgate --create-home idemgate
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
COPY config.example.toml /etc/idemgate/idemgate.toml
USER 10001
WORKDIR /var/lib/idemgate
VOLUME ["/var/lib/idemgate"]
EXPOSE 8080 9901
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["idemgate", "health", "--config", "/etc/idemgate/idemgate.toml"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["idemgate"]
CMD ["--config", "/etc/idemgate/idemgate.toml"]
