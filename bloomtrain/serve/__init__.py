"""`bloomtrain serve`: an OpenAI- and vLLM-compatible server for the models bloomtrain trains,
split along vLLM's lines (the README's architecture map names each module: protocol, chat,
server, interface, remote, engine, outputs, scheduler, sampling, detokenize, kv_cache, runner,
quantize, tp, metrics, cli). Importing this package loads nothing heavy; the modules import
torch and aiohttp themselves.
"""
