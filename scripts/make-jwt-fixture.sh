#!/bin/sh
# Makes the RSA signing key the JWT tests use for RS256 (ring, which the tests sign with,
# cannot generate RSA keys): a 2048-bit key as PKCS#1 DER (what jsonwebtoken's from_rsa_der
# reads) and its public JWK (n, e). A test key only: it signs tokens for a loopback JWKS
# server and guards nothing.
set -eu
dir="$(dirname "$0")/../tests/fixtures/jwt"
mkdir -p "$dir"
pem=$(mktemp)
trap 'rm -f "$pem"' EXIT
openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pem" 2>/dev/null
openssl rsa -in "$pem" -traditional -outform DER -out "$dir/rs256.key.der" 2>/dev/null
modulus=$(openssl rsa -in "$pem" -noout -modulus | cut -d= -f2)
n=$(printf '%s' "$modulus" | xxd -r -p | base64 -w0 | tr '+/' '-_' | tr -d '=')
printf '{"kty":"RSA","n":"%s","e":"AQAB"}\n' "$n" > "$dir/rs256.jwk.json"
