"""Container health check for FlashMap Serve images (exit 0 = healthy, 1 = not).

    python healthcheck.py grpc 127.0.0.1:50051 [service]   # standard grpc.health.v1 Check
    python healthcheck.py http http://127.0.0.1:8000/v2/health/ready
    python healthcheck.py triton 127.0.0.1:8001             # a real request through the model

The triton mode sends an INFO request through the FlashMap target model on Triton's gRPC
stream, with the key in $FLASHMAP_TARGET_KEY (target_service.launcher.probe): Triton's own
readiness stays green when the model's Python stub has died, this does not.

Why a script: the slim images carry neither curl nor grpc_health_probe, and a Python one-liner in
docker-compose.yml would be unreadable. The http mode uses only the standard library; the triton
mode needs grpcio and tritonclient, which the Triton image carries (deploy/requirements/triton.txt).
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def check_http(url: str, timeout: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300, f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, str(e)


def check_grpc(target: str, service: str, timeout: float) -> tuple[bool, str]:
    # Imported here so the http mode works where grpcio is not installed (Triton image).
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    sub = p.add_subparsers(dest="mode", required=True)
    g = sub.add_parser("grpc")
    g.add_argument("target", help="host:port")
    g.add_argument("service", nargs="?", default="", help="service name; empty = whole server")
    h = sub.add_parser("http")
    h.add_argument("url")
    t = sub.add_parser("triton")
    t.add_argument("url", help="Triton's gRPC address, e.g. 127.0.0.1:8001")
    args = p.parse_args(argv)

    if args.mode == "grpc":
        ok, detail = check_grpc(args.target, args.service, args.timeout)
        where = args.target
    elif args.mode == "triton":
        from flashmap.auth import TARGET_KEY_ENV, read_secret
        from target_service.launcher import probe

        ok, detail = probe(args.url, read_secret(TARGET_KEY_ENV), args.timeout)
        where = args.url
    else:
        ok, detail = check_http(args.url, args.timeout)
        where = args.url
    print(f"{'healthy' if ok else 'unhealthy'}: {where}: {detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
