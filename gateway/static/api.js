// The public CDE API, as any client would call it: JSON requests and an SSE reader for POST
// streams (EventSource cannot POST), which yields {kind, data} per event; kind is null for
// OpenAI's unnamed chunks and "step" for the stream_denoise events.

// status and code (the API's error.code) let the page act on a refusal, e.g. chat_not_supported.
export class ApiError extends Error {
  constructor(message, status = null, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export class Api {
  constructor(getKey) {
    this.getKey = getKey;
  }

  headers() {
    const key = this.getKey();
    return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
  }

  async get(path) {
    const r = await fetch(`/v1${path}`, { headers: this.headers() });
    return this.json(r);
  }

  async json(r) {
    const body = await r.json();
    if (!r.ok) {
      const err = body.error || {};
      const message = `${r.status}: ${err.message || r.statusText}${err.param ? ` (${err.param})` : ""}`;
      throw new ApiError(message, r.status, err.code ?? null);
    }
    return body;
  }

  async *stream(path, body, signal) {
    const r = await fetch(`/v1${path}`, { method: "POST", headers: this.headers(), body: JSON.stringify(body), signal });
    if (!r.ok) await this.json(r);
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = parseEvent(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
        if (event.data === "[DONE]") return;
        if (event.data.error) throw new ApiError(event.data.error.message);
        yield event;
      }
    }
  }
}

function parseEvent(text) {
  let kind = null;
  let data = "";
  for (const line of text.split("\n")) {
    if (line.startsWith("event: ")) kind = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  return { kind, data: data === "[DONE]" ? data : JSON.parse(data) };
}
