"""Domain building blocks shared by the services: errors, clocks, names, hash chains.

Nothing here imports grpc.
"""
