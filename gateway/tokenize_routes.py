"""vLLM's POST /tokenize and POST /detokenize, with its request and response shapes: the token
ids a prompt or a chat becomes on this server, and the text of token ids.

Bounded like the generation routes: a text that cannot fit the context is refused untokenized,
a long one is tokenized on a thread (gateway/prompts.py), and more ids than the context holds are
refused (as vLLM does); at most the context's length of ids is decoded (cheap: inline)."""

from __future__ import annotations

from cde.gateway.errors import invalid
from cde.gateway.http_utils import read_body
from cde.gateway.params import as_invalid
from cde.gateway.prompts import encode_chat, encode_prompts
from cde.gateway.state import ServerState
from cde.gateway.tokenize_schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from cde.gateway.tools import render_messages
from cde.shared.config import BOS_ID, EOS_ID
from cde.shared.limits import check_context, check_token_ids
from cde.shared.tokenizer import Tokenizer, get_tokenizer
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    body = (await read_body(request, TokenizeRequest)).root
    info = state.model_info(body.model)
    tok = get_tokenizer(info.instruct)
    if isinstance(body, TokenizeChatRequest):
        if not info.instruct:
            raise invalid("a base checkpoint has no chat template; send a prompt", "messages", "chat_not_supported")
        turns = render_messages(body.messages, body.tools)
        ids = await encode_chat(tok, turns, info, body.add_generation_prompt, body.continue_final_message)
    else:
        (ids,) = await encode_prompts(tok, [body.prompt], info)
    if body.add_special_tokens:
        ids = [BOS_ID, *ids, EOS_ID]
    with as_invalid():  # as vLLM: what the model could not take is refused (and token_strs stay bounded)
        check_context(len(ids), 0, info.context_len, "messages" if isinstance(body, TokenizeChatRequest) else "prompt")
    out: dict = {"count": len(ids), "max_model_len": info.context_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tok.token_str(t) for t in ids]
    return JSONResponse(out)


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    body = await read_body(request, DetokenizeRequest)
    info = state.model_info(body.model)
    if len(body.tokens) > info.context_len:
        message = f"at most {info.context_len} token ids (this model's context)"
        raise invalid(message, "tokens", "context_length_exceeded")
    with as_invalid():
        check_token_ids(body.tokens, info.vocab_size, "tokens")
    tok: Tokenizer = get_tokenizer(info.instruct)
    return JSONResponse({"prompt": tok.decode_with_specials(body.tokens)})
