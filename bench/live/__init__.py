"""`pdserve bench`: load tests against a running pdserve endpoint (gRPC), measured at the client."""
