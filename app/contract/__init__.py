"""What the gateway and its workers must agree on, imported by both sides.

The worker is its own process and imports nothing of the gateway; the gateway's API
must still admit exactly what a worker's engine can serve, and both must hold the worker
token to the same rules. Those rules live here, in a leaf that imports nothing of app/:
``engine_inputs`` (what the engines read of a request, checked to that depth) and
``worker_token`` (what a usable token is, where it comes from).
"""
