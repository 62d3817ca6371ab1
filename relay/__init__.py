"""The weight data plane: relays that hold policy versions in CPU memory and pass them down a chain.

Public surface: `relay.server.RelayServer`, the functions of `relay.client`, and the frame format in
`relay.protocol`. Nothing here imports Temporal; activities wrap it.
"""
