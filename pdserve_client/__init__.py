"""What agent backends import to call pdserve: its gRPC API (`pdserve_client.api`, generated from
proto/pdserve/v1/pdserve.proto) and a Python SDK over it (`pdserve_client.sdk`). Nothing of the router.

    from pdserve_client import PdserveClient
"""

from pdserve_client.sdk import AsyncPdserveClient, Completion, PdserveClient, PdserveError

__all__ = ["AsyncPdserveClient", "Completion", "PdserveClient", "PdserveError"]
