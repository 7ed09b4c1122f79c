"""The loader service: a process beside the trainer that runs a Loader's passes.

`server` runs one trainer's passes (`service="process"`), `node_server` every rank's of a node
(`service="node"`); `client` is the trainer's side of the socket, `holder` a Loader's hold on
its service, `rendezvous` how a node's ranks find (or start) their one service, and `messages`
what crosses the socket. The zygote starts `server` by its module name; nothing below this
package imports it.
"""
