"""The official Python clients over TLS, trusting oqp's certificate through a CA bundle.

Run by tests/clients/run.sh against a second oqp whose proxy port serves TLS
(`proxy.tls`) with a certificate for 127.0.0.1 issued by a throwaway CA
(`test-ca`, rcgen). A client given the CA bundle is served over HTTPS; one that
trusts only the system's roots refuses the certificate and sends nothing.
Every check runs; any failure makes the exit status 1.

Environment: OQP_TLS_URL (https://127.0.0.1:PORT), OLLAMA_API_KEY (an oqp
key), OQP_CA_BUNDLE (the CA's PEM), OQP_CHAT_MODEL (default llama3.2).
"""

import os
import ssl
import sys
import traceback

import httpx
import ollama
import openai

URL = os.environ["OQP_TLS_URL"]
KEY = os.environ["OLLAMA_API_KEY"]
CA = os.environ["OQP_CA_BUNDLE"]
CHAT = os.environ.get("OQP_CHAT_MODEL", "llama3.2")
MESSAGES = [{"role": "user", "content": "Say hello."}]

CHECKS = []


def check(name):
    def register(function):
        CHECKS.append((name, function))
        return function

    return register


def expect(condition, message):
    if not condition:
        raise AssertionError(message)


def trusting_the_ca():
    return ssl.create_default_context(cafile=CA)


def ollama_client(verify):
    return ollama.Client(host=URL, verify=verify, headers={"Authorization": f"Bearer {KEY}"})


def openai_client(verify):
    return openai.OpenAI(
        base_url=URL + "/v1",
        api_key=KEY,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=verify),
    )


def refused_certificate(error):
    """Whether `error` (or what caused it) is a failed certificate verification."""
    seen = error
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(
            seen
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@check("ollama: chat over TLS with the CA bundle")
def ollama_chat():
    response = ollama_client(trusting_the_ca()).chat(model=CHAT, messages=MESSAGES)
    expect(isinstance(response.message.content, str), f"no message: {response!r}")
    expect(response.done, "the answer did not finish")


@check("ollama: streamed chat over TLS")
def ollama_stream():
    chunks = list(
        ollama_client(trusting_the_ca()).chat(model=CHAT, messages=MESSAGES, stream=True)
    )
    expect(len(chunks) > 1, f"{len(chunks)} chunks")
    expect(chunks[-1].done, "the stream did not end with done")


@check("openai: chat completion over TLS with the CA bundle")
def openai_chat():
    completion = openai_client(trusting_the_ca()).chat.completions.create(
        model=CHAT, messages=MESSAGES
    )
    expect(completion.choices[0].message.role == "assistant", repr(completion))


@check("openai: streamed chat completion over TLS")
def openai_stream():
    stream = openai_client(trusting_the_ca()).chat.completions.create(
        model=CHAT, messages=MESSAGES, stream=True
    )
    chunks = list(stream)
    expect(len(chunks) > 1, f"{len(chunks)} chunks")


@check("ollama: without the CA bundle the certificate is refused")
def ollama_untrusted():
    try:
        ollama_client(True).chat(model=CHAT, messages=MESSAGES)
    except (httpx.ConnectError, ConnectionError) as error:
        expect(refused_certificate(error), f"refused, but not for the certificate: {error!r}")
    else:
        raise AssertionError("an untrusted certificate was accepted")


@check("openai: without the CA bundle the certificate is refused")
def openai_untrusted():
    try:
        openai_client(True).chat.completions.create(model=CHAT, messages=MESSAGES)
    except openai.APIConnectionError as error:
        expect(refused_certificate(error), f"refused, but not for the certificate: {error!r}")
    else:
        raise AssertionError("an untrusted certificate was accepted")


def main():
    print(f"through {URL}, trusting {CA}")
    failed = []
    for name, function in CHECKS:
        try:
            function()
        except Exception as error:  # noqa: BLE001 - every failure is reported
            failed.append(name)
            print(f"FAIL {name}: {type(error).__name__}: {error}")
            traceback.print_exc(limit=3, file=sys.stdout)
        else:
            print(f"ok   {name}")
    print(f"{len(CHECKS) - len(failed)} of {len(CHECKS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
