/* The fast lane in compiled code: one worker subscription's `DeltaBatch`, read from its wire bytes,
 * and every ordinary mid-stream delta of a streamed SSE request written to its connection here,
 * without a Python frame per token.
 *
 * `dispatch(batch, inboxes, from_string)` walks the batch's items. An item whose request's inbox
 * carries an armed `NativeLane` (`inbox.native`), and which that lane can take, becomes one SSE
 * event: the request's constant head, the token text as a JSON string (escaped exactly as
 * `json.encoder.encode_basestring` does, with U+0085, U+2028 and U+2029 escaped as well), the
 * constant tail, in uvicorn's chunked framing, handed to the connection's `transport.write`. Every
 * other item is parsed by `from_string` (the generated `SampleDelta.FromString`) and given to
 * `inbox.put`, which is what the Python reader does with every item.
 *
 * A lane takes a delta only when nothing about it needs the router's or the gateway's Python: it
 * does not finish its sample, carries no logprobs, no stop reason, no error, no field this parser
 * does not know; it starts exactly where the client is (the router's progress and assembler at the
 * same edge, no stop-string holdback: the Python side checks that when it arms the lane); its text
 * is valid UTF-8; and the connection can take a write now (the same checks as `SseLane.ready`).
 * What the lane took is kept (token ids, text, times) until the Python side asks for it
 * (`take_pending`) and replays it into the request's Python objects, before anything there reads
 * them: see `services/common/fast_lane.py`.
 *
 * A lane made with `grpc=True` serves a streamed `deepinfer.v1.Gateway/Generate` instead: each delta
 * it takes becomes the `GenerateResponse` the gRPC front door would have sent for it, as wire bytes
 * (the request id, then the delta at the client's offsets), handed to its owner's `write`; its
 * owner's `ready()` says whether it takes one now (`services/gateway/grpc_lane.py`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ---- wire format ---------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *p, *end;
} Reader;

static int read_varint(Reader *r, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (r->p >= r->end) return -1;
        uint8_t b = *r->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* A length-delimited field's bytes. */
static int read_bytes(Reader *r, const uint8_t **start, Py_ssize_t *len) {
    uint64_t n;
    if (read_varint(r, &n) < 0 || n > (uint64_t)(r->end - r->p)) return -1;
    *start = r->p;
    *len = (Py_ssize_t)n;
    r->p += n;
    return 0;
}

static int skip_field(Reader *r, int wire) {
    uint64_t v;
    const uint8_t *s;
    Py_ssize_t n;
    switch (wire) {
    case 0: return read_varint(r, &v);
    case 1: if (r->end - r->p < 8) return -1; r->p += 8; return 0;
    case 2: return read_bytes(r, &s, &n);
    case 5: if (r->end - r->p < 4) return -1; r->p += 4; return 0;
    default: return -1;
    }
}

/* What the lane needs of one `SampleDelta`; `plain` is false when it carries anything the lane does
 * not take (a finish, logprobs, a stop reason, an error, an unknown field) or cannot be read. */
typedef struct {
    int plain;
    uint64_t token_offset, text_offset, num_cached;
    const uint8_t *ids;   /* packed token ids (or NULL), and their count */
    Py_ssize_t ids_len;
    Py_ssize_t n_ids;
    const uint8_t *text;
    Py_ssize_t text_len;
} Delta;

static void parse_delta(const uint8_t *p, Py_ssize_t len, Delta *d) {
    Reader r = {p, p + len};
    memset(d, 0, sizeof *d);
    d->plain = 1;
    while (r.p < r.end) {
        uint64_t key, v;
        const uint8_t *s;
        Py_ssize_t n;
        if (read_varint(&r, &key) < 0) goto not_plain;
        int field = (int)(key >> 3), wire = (int)(key & 7);
        switch (field) {
        case 1: /* index: one sample, so it does not change what the client sees */
        case 2:
        case 4:
        case 11:
            if (wire != 0 || read_varint(&r, &v) < 0) goto not_plain;
            if (field == 2) d->token_offset = v;
            else if (field == 4) d->text_offset = v;
            else if (field == 11) d->num_cached = v;
            break;
        case 3: /* token ids, packed (unpacked ones are never sent: left to the parser) */
            if (wire != 2 || d->ids != NULL || read_bytes(&r, &s, &n) < 0) goto not_plain;
            d->ids = s;
            d->ids_len = n;
            {
                Reader q = {s, s + n};
                while (q.p < q.end) {
                    if (read_varint(&q, &v) < 0 || v > 0x7fffffff) goto not_plain;
                    d->n_ids++;
                }
            }
            break;
        case 5:
            if (wire != 2 || read_bytes(&r, &s, &n) < 0) goto not_plain;
            d->text = s;
            d->text_len = n;
            break;
        case 7:
        case 10: /* a finish reason or an error: empty means none */
            if (wire != 2 || read_bytes(&r, &s, &n) < 0 || n != 0) goto not_plain;
            break;
        default: /* logprobs (6), a stop reason (8, 9), anything newer */
            goto not_plain;
        }
    }
    return;
not_plain:
    d->plain = 0;
}

/* Characters of valid UTF-8 text (-1: not valid), as Python's `len` of the decoded string. */
static Py_ssize_t utf8_chars(const uint8_t *s, Py_ssize_t n) {
    Py_ssize_t chars = 0, i = 0;
    while (i < n) {
        uint8_t c = s[i];
        int k;
        uint32_t cp;
        if (c < 0x80) {
            i++;
            chars++;
            continue;
        }
        if (c >= 0xc2 && c <= 0xdf) { k = 1; cp = c & 0x1f; }
        else if ((c & 0xf0) == 0xe0) { k = 2; cp = c & 0x0f; }
        else if (c >= 0xf0 && c <= 0xf4) { k = 3; cp = c & 0x07; }
        else return -1;
        if (i + k >= n) return -1;
        for (int j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return -1;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if (k == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) return -1;
        if (k == 3 && (cp < 0x10000 || cp > 0x10ffff)) return -1;
        i += k + 1;
        chars++;
    }
    return chars;
}

/* ---- JSON string ---------------------------------------------------------------------------- */

static const char HEX[] = "0123456789abcdef";

/* Bytes `s` takes inside a JSON string literal (quotes included). */
static Py_ssize_t escaped_len(const uint8_t *s, Py_ssize_t n) {
    Py_ssize_t out = 2;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t c = s[i];
        if (c == '"' || c == '\\' || c == '\b' || c == '\f' || c == '\n' || c == '\r' || c == '\t') out += 2;
        else if (c < 0x20) out += 6;
        else if (c == 0xc2 && i + 1 < n && s[i + 1] == 0x85) { out += 6; i++; }
        else if (c == 0xe2 && i + 2 < n && s[i + 1] == 0x80 && (s[i + 2] == 0xa8 || s[i + 2] == 0xa9)) { out += 6; i += 2; }
        else out += 1;
    }
    return out;
}

static char *escape_unicode(char *o, uint32_t cp) {
    *o++ = '\\';
    *o++ = 'u';
    *o++ = HEX[(cp >> 12) & 0xf];
    *o++ = HEX[(cp >> 8) & 0xf];
    *o++ = HEX[(cp >> 4) & 0xf];
    *o++ = HEX[cp & 0xf];
    return o;
}

static char *write_escaped(char *o, const uint8_t *s, Py_ssize_t n) {
    *o++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t c = s[i];
        switch (c) {
        case '"': *o++ = '\\'; *o++ = '"'; continue;
        case '\\': *o++ = '\\'; *o++ = '\\'; continue;
        case '\b': *o++ = '\\'; *o++ = 'b'; continue;
        case '\f': *o++ = '\\'; *o++ = 'f'; continue;
        case '\n': *o++ = '\\'; *o++ = 'n'; continue;
        case '\r': *o++ = '\\'; *o++ = 'r'; continue;
        case '\t': *o++ = '\\'; *o++ = 't'; continue;
        default: break;
        }
        if (c < 0x20) o = escape_unicode(o, c);
        else if (c == 0xc2 && i + 1 < n && s[i + 1] == 0x85) { o = escape_unicode(o, 0x85); i++; }
        else if (c == 0xe2 && i + 2 < n && s[i + 1] == 0x80 && (s[i + 2] == 0xa8 || s[i + 2] == 0xa9)) {
            o = escape_unicode(o, s[i + 2] == 0xa8 ? 0x2028 : 0x2029);
            i += 2;
        } else *o++ = (char)c;
    }
    *o++ = '"';
    return o;
}

/* ---- NativeLane ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *transport, *cycle, *flow; /* the connection: where events go, and whether they can */
    PyObject *head, *tail;              /* bytes: the event around the text */
    int skip_empty;                     /* chat: a delta without text sends no event */
    int grpc;                           /* events are GenerateResponse bytes; `transport` is the lane's owner */
    int armed;
    /* where the client is, in the sample's tokens and characters; and where the current attempt's
     * output starts in them (after a migration) */
    uint64_t tokens, chars, base_tokens, base_chars;
    /* taken since the last `take_pending` */
    int32_t *ids;
    Py_ssize_t n_ids, cap_ids;
    char *text;
    Py_ssize_t n_text, cap_text;
    Py_ssize_t n_taken;
    uint64_t from_tokens, from_chars;   /* the edge at the first of them */
    uint64_t clean_tokens, clean_chars; /* after the last one-token delta ending on a whole character */
    int has_clean;
    uint64_t num_cached;
    uint64_t sample_cached;             /* the sample's cached prompt tokens so far (what its deltas say) */
    double first_at, last_at;
} NativeLane;

static PyTypeObject NativeLaneType;
static unsigned long long TAKEN = 0;
static PyObject *S_DISCONNECTED, *S_RESPONSE_COMPLETE, *S_WRITE_PAUSED, *S_IS_CLOSING, *S_WRITE, *S_NATIVE, *S_PUT,
    *S_SINK_FAILED, *S_READY;

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int lane_init(NativeLane *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"transport", "cycle", "flow", "head", "tail", "skip_empty", "grpc", NULL};
    PyObject *transport, *cycle, *flow, *head, *tail;
    int skip_empty = 0, grpc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOSS|pp", kwlist, &transport, &cycle, &flow, &head, &tail,
                                     &skip_empty, &grpc))
        return -1;
    Py_INCREF(transport); Py_XSETREF(self->transport, transport);
    Py_INCREF(cycle); Py_XSETREF(self->cycle, cycle);
    Py_INCREF(flow); Py_XSETREF(self->flow, flow);
    Py_INCREF(head); Py_XSETREF(self->head, head);
    Py_INCREF(tail); Py_XSETREF(self->tail, tail);
    self->skip_empty = skip_empty;
    self->grpc = grpc;
    self->armed = 0;
    return 0;
}

/* The connection's objects may lead back to the request (and so to this lane): the collector sees them. */
static int lane_traverse(NativeLane *self, visitproc visit, void *arg) {
    Py_VISIT(self->transport);
    Py_VISIT(self->cycle);
    Py_VISIT(self->flow);
    return 0;
}

static int lane_clear(NativeLane *self) {
    Py_CLEAR(self->transport);
    Py_CLEAR(self->cycle);
    Py_CLEAR(self->flow);
    Py_CLEAR(self->head);
    Py_CLEAR(self->tail);
    self->armed = 0;
    return 0;
}

static void lane_dealloc(NativeLane *self) {
    PyObject_GC_UnTrack(self);
    lane_clear(self);
    PyMem_Free(self->ids);
    PyMem_Free(self->text);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *lane_arm(NativeLane *self, PyObject *args) {
    unsigned long long t, c, bt, bc, cached = 0;
    if (!PyArg_ParseTuple(args, "KKKK|K", &t, &c, &bt, &bc, &cached)) return NULL;
    if (self->transport == NULL || self->head == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "arm: the lane has no connection");
        return NULL;
    }
    if (self->n_taken) {
        PyErr_SetString(PyExc_RuntimeError, "arm: what the lane took was not taken back first");
        return NULL;
    }
    self->tokens = t;
    self->chars = c;
    self->base_tokens = bt;
    self->base_chars = bc;
    self->sample_cached = cached;
    self->armed = 1;
    Py_RETURN_NONE;
}

static PyObject *lane_disarm(NativeLane *self, PyObject *unused) {
    self->armed = 0;
    Py_RETURN_NONE;
}

/* (token_offset, token_ids, text_offset, text, num_cached_tokens, first_at, last_at, clean) of what
 * was taken since the last call, in the current attempt's offsets (as its worker sent them), or
 * None; clean: (tokens, chars) or None. */
static PyObject *lane_take_pending(NativeLane *self, PyObject *unused) {
    if (!self->n_taken) Py_RETURN_NONE;
    PyObject *ids = PyList_New(self->n_ids);
    if (ids == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->n_ids; i++) {
        PyObject *v = PyLong_FromLong(self->ids[i]);
        if (v == NULL) { Py_DECREF(ids); return NULL; }
        PyList_SET_ITEM(ids, i, v);
    }
    PyObject *clean;
    if (self->has_clean) clean = Py_BuildValue("(KK)", (unsigned long long)self->clean_tokens,
                                               (unsigned long long)self->clean_chars);
    else { clean = Py_None; Py_INCREF(clean); }
    if (clean == NULL) { Py_DECREF(ids); return NULL; }
    PyObject *out = Py_BuildValue("(KNKs#KddN)", (unsigned long long)(self->from_tokens - self->base_tokens), ids,
                                  (unsigned long long)(self->from_chars - self->base_chars), self->text ? self->text : "",
                                  self->n_text, (unsigned long long)self->num_cached, self->first_at,
                                  self->last_at, clean);
    if (out == NULL) return NULL;
    self->n_taken = 0;
    self->n_ids = 0;
    self->n_text = 0;
    self->has_clean = 0;
    self->num_cached = 0;
    return out;
}

static PyObject *lane_get_armed(NativeLane *self, void *c) { return PyBool_FromLong(self->armed); }
static PyObject *lane_get_pending(NativeLane *self, void *c) { return PyLong_FromSsize_t(self->n_taken); }
static PyObject *lane_get_edge(NativeLane *self, void *c) {
    return Py_BuildValue("(KK)", (unsigned long long)self->tokens, (unsigned long long)self->chars);
}

static int truthy_attr(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* Whether the connection can take a write now (`SseLane.ready`); -1: an error is set. */
static int lane_ready(NativeLane *self) {
    int t;
    if (self->grpc) {
        PyObject *ready = PyObject_CallMethodNoArgs(self->transport, S_READY);
        if (ready == NULL) return -1;
        t = PyObject_IsTrue(ready);
        Py_DECREF(ready);
        return t;
    }
    if ((t = truthy_attr(self->cycle, S_DISCONNECTED)) != 0) return t < 0 ? -1 : 0;
    if ((t = truthy_attr(self->cycle, S_RESPONSE_COMPLETE)) != 0) return t < 0 ? -1 : 0;
    if ((t = truthy_attr(self->flow, S_WRITE_PAUSED)) != 0) return t < 0 ? -1 : 0;
    PyObject *closing = PyObject_CallMethodNoArgs(self->transport, S_IS_CLOSING);
    if (closing == NULL) return -1;
    t = PyObject_IsTrue(closing);
    Py_DECREF(closing);
    return t < 0 ? -1 : !t;
}

static int grow(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t cap2 = *cap ? *cap : 64;
    while (cap2 < need) cap2 *= 2;
    void *b = PyMem_Realloc(*buf, (size_t)cap2 * item);
    if (b == NULL) { PyErr_NoMemory(); return -1; }
    *buf = b;
    *cap = cap2;
    return 0;
}

static uint8_t *put_varint_at(uint8_t *o, uint64_t v) {
    while (v >= 0x80) {
        *o++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *o++ = (uint8_t)v;
    return o;
}

static Py_ssize_t varint_size(uint64_t v) {
    Py_ssize_t n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}

/* `d`'s SSE event in uvicorn's chunked framing: the head, the text as a JSON string, the tail. */
static PyObject *sse_event(NativeLane *self, const Delta *d) {
    Py_ssize_t head = PyBytes_GET_SIZE(self->head), tail = PyBytes_GET_SIZE(self->tail);
    Py_ssize_t body = head + escaped_len(d->text, d->text_len) + tail;
    char hex[24];
    int hex_len = snprintf(hex, sizeof hex, "%zx\r\n", body);
    PyObject *event = PyBytes_FromStringAndSize(NULL, hex_len + body + 2);
    if (event == NULL) return NULL;
    char *o = PyBytes_AS_STRING(event);
    memcpy(o, hex, (size_t)hex_len); o += hex_len;
    memcpy(o, PyBytes_AS_STRING(self->head), (size_t)head); o += head;
    o = write_escaped(o, d->text, d->text_len);
    memcpy(o, PyBytes_AS_STRING(self->tail), (size_t)tail); o += tail;
    *o++ = '\r';
    *o++ = '\n';
    return event;
}

/* `d`'s `GenerateResponse` as its serializer writes it: the head (the request id's field), then the
 * delta (field 2) with the fields that are not at their default, in field order: token_offset and
 * text_offset where the client is, the token ids (the worker's packed bytes as they came), the
 * text, and the sample's cached prompt tokens. One sample: its index is 0, never written. */
static PyObject *grpc_event(NativeLane *self, const Delta *d) {
    uint64_t tokens = self->tokens, chars = self->chars, cached = self->sample_cached;
    Py_ssize_t inner = 0;
    if (tokens) inner += 1 + varint_size(tokens);
    if (d->ids_len) inner += 1 + varint_size((uint64_t)d->ids_len) + d->ids_len;
    if (chars) inner += 1 + varint_size(chars);
    if (d->text_len) inner += 1 + varint_size((uint64_t)d->text_len) + d->text_len;
    if (cached) inner += 1 + varint_size(cached);
    Py_ssize_t head = PyBytes_GET_SIZE(self->head);
    PyObject *event = PyBytes_FromStringAndSize(NULL, head + 1 + varint_size((uint64_t)inner) + inner);
    if (event == NULL) return NULL;
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(event);
    memcpy(o, PyBytes_AS_STRING(self->head), (size_t)head); o += head;
    *o++ = 0x12; /* delta: field 2, length-delimited */
    o = put_varint_at(o, (uint64_t)inner);
    if (tokens) { *o++ = 0x10; o = put_varint_at(o, tokens); }
    if (d->ids_len) {
        *o++ = 0x1a;
        o = put_varint_at(o, (uint64_t)d->ids_len);
        memcpy(o, d->ids, (size_t)d->ids_len); o += d->ids_len;
    }
    if (chars) { *o++ = 0x20; o = put_varint_at(o, chars); }
    if (d->text_len) {
        *o++ = 0x2a;
        o = put_varint_at(o, (uint64_t)d->text_len);
        memcpy(o, d->text, (size_t)d->text_len); o += d->text_len;
    }
    if (cached) { *o++ = 0x58; o = put_varint_at(o, cached); }
    return event;
}

/* `d` taken: its event written, if the Python side would write one, and what it carried kept for
 * the replay; 0: done, -1: an error is set. The caller checked it can be taken. */
static int lane_take(NativeLane *self, const Delta *d, Py_ssize_t chars) {
    if (d->num_cached > self->sample_cached) self->sample_cached = d->num_cached;
    /* a delta with neither tokens nor text gives the client nothing (`SampleAssembler.push`) */
    int send = (d->n_ids || d->text_len) && (self->grpc || d->text_len || !self->skip_empty);
    if (send) {
        PyObject *event = self->grpc ? grpc_event(self, d) : sse_event(self, d);
        if (event == NULL) return -1;
        PyObject *r = PyObject_CallMethodOneArg(self->transport, S_WRITE, event);
        Py_DECREF(event);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    if (grow((void **)&self->ids, &self->cap_ids, self->n_ids + d->n_ids, sizeof(int32_t)) < 0) return -1;
    if (grow((void **)&self->text, &self->cap_text, self->n_text + d->text_len, 1) < 0) return -1;
    Reader q = {d->ids, d->ids + d->ids_len};
    for (Py_ssize_t i = 0; i < d->n_ids; i++) {
        uint64_t v = 0;
        read_varint(&q, &v);
        self->ids[self->n_ids++] = (int32_t)v;
    }
    if (d->text_len) memcpy(self->text + self->n_text, d->text, (size_t)d->text_len);
    self->n_text += d->text_len;
    double now = monotonic();
    if (self->n_taken++ == 0) {
        self->from_tokens = self->tokens;
        self->from_chars = self->chars;
        self->first_at = now;
    }
    self->last_at = now;
    self->tokens += (uint64_t)d->n_ids;
    self->chars += (uint64_t)chars;
    if (d->num_cached > self->num_cached) self->num_cached = d->num_cached;
    /* `SampleProgress.place`'s clean point: one token whose text ends on a whole character */
    if (d->n_ids == 1 && d->text_len &&
        !(d->text_len >= 3 && d->text[d->text_len - 3] == 0xef && d->text[d->text_len - 2] == 0xbf &&
          d->text[d->text_len - 1] == 0xbd)) {
        self->clean_tokens = self->tokens;
        self->clean_chars = self->chars;
        self->has_clean = 1;
    }
    TAKEN++;
    return 0;
}

/* 1: `lane` took `d`; 0: it does not take it; -1: an error is set. */
static int lane_offer(NativeLane *self, const Delta *d) {
    if (!self->armed || !d->plain) return 0;
    if (d->token_offset + self->base_tokens != self->tokens || d->text_offset + self->base_chars != self->chars)
        return 0;
    Py_ssize_t chars = utf8_chars(d->text, d->text_len);
    if (chars < 0) return 0;
    int ready = lane_ready(self);
    if (ready <= 0) return ready;
    return lane_take(self, d, chars) < 0 ? -1 : 1;
}

static PyMethodDef lane_methods[] = {
    {"arm", (PyCFunction)lane_arm, METH_VARARGS,
     "arm(tokens, chars, base_tokens, base_chars, cached=0): take deltas starting at this edge of the sample "
     "(cached: the prompt tokens its deltas said were cached so far)"},
    {"disarm", (PyCFunction)lane_disarm, METH_NOARGS, "take no delta until armed again"},
    {"take_pending", (PyCFunction)lane_take_pending, METH_NOARGS,
     "what was taken since the last call, as one delta's fields, or None"},
    {NULL}};

static PyGetSetDef lane_getset[] = {
    {"armed", (getter)lane_get_armed, NULL, "whether deltas are taken", NULL},
    {"pending", (getter)lane_get_pending, NULL, "deltas taken since the last take_pending", NULL},
    {"edge", (getter)lane_get_edge, NULL, "(tokens, chars) the client has of the sample", NULL},
    {NULL}};

static PyTypeObject NativeLaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "services.native._delta_lane.NativeLane",
    .tp_basicsize = sizeof(NativeLane),
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)lane_traverse,
    .tp_clear = (inquiry)lane_clear,
    .tp_doc = "NativeLane(transport, cycle, flow, head, tail, skip_empty=False, grpc=False): one streamed "
              "request's SSE events (or, with grpc, its GenerateResponse messages) written from the "
              "subscription's bytes",
    .tp_methods = lane_methods,
    .tp_getset = lane_getset,
    .tp_init = (initproc)lane_init,
    .tp_new = PyType_GenericNew,
};

/* ---- dispatch ------------------------------------------------------------------------------- */

/* `inbox.put(from_string(delta_bytes))`; on a lane failure, `inbox.sink_failed(error)`. */
static int put(PyObject *inbox, PyObject *from_string, const uint8_t *delta, Py_ssize_t len) {
    PyObject *raw = PyBytes_FromStringAndSize((const char *)delta, len);
    if (raw == NULL) return -1;
    PyObject *msg = PyObject_CallOneArg(from_string, raw);
    Py_DECREF(raw);
    if (msg == NULL) return -1;
    PyObject *r = PyObject_CallMethodOneArg(inbox, S_PUT, msg);
    Py_DECREF(msg);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "dispatch(batch: bytes, inboxes: dict, from_string)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *inboxes = args[1], *from_string = args[2];
    Reader r = {view.buf, (const uint8_t *)view.buf + view.len};
    int failed = 0;
    while (r.p < r.end && !failed) {
        uint64_t key;
        if (read_varint(&r, &key) < 0) goto malformed;
        if (key >> 3 != 1 || (key & 7) != 2) {
            if (skip_field(&r, (int)(key & 7)) < 0) goto malformed;
            continue;
        }
        const uint8_t *item;
        Py_ssize_t item_len;
        if (read_bytes(&r, &item, &item_len) < 0) goto malformed;
        /* RequestDelta: request_id (1), delta (2) */
        Reader q = {item, item + item_len};
        const uint8_t *rid = NULL, *delta = (const uint8_t *)"";
        Py_ssize_t rid_len = 0, delta_len = 0;
        while (q.p < q.end) {
            uint64_t k;
            if (read_varint(&q, &k) < 0) goto malformed;
            if ((k & 7) == 2 && (k >> 3) == 1) { if (read_bytes(&q, &rid, &rid_len) < 0) goto malformed; }
            else if ((k & 7) == 2 && (k >> 3) == 2) { if (read_bytes(&q, &delta, &delta_len) < 0) goto malformed; }
            else if (skip_field(&q, (int)(k & 7)) < 0) goto malformed;
        }
        PyObject *key_str = PyUnicode_DecodeUTF8(rid ? (const char *)rid : "", rid_len, "strict");
        if (key_str == NULL) goto malformed;
        PyObject *inbox = PyDict_GetItemWithError(inboxes, key_str); /* borrowed */
        Py_DECREF(key_str);
        if (inbox == NULL) {
            if (PyErr_Occurred()) { failed = 1; break; }
            continue; /* a request the router has let go (aborted, deadline) */
        }
        Py_INCREF(inbox);
        int took = 0;
        PyObject *native = PyObject_GetAttr(inbox, S_NATIVE);
        if (native == NULL) failed = 1;
        else if (Py_IS_TYPE(native, &NativeLaneType) && ((NativeLane *)native)->armed) {
            Delta d;
            parse_delta(delta, delta_len, &d);
            took = lane_offer((NativeLane *)native, &d);
            if (took < 0) { /* a bug or a broken connection: this request ends, not the subscription */
                PyObject *type, *value, *tb;
                PyErr_Fetch(&type, &value, &tb);
                PyErr_NormalizeException(&type, &value, &tb);
                ((NativeLane *)native)->armed = 0;
                PyObject *res = PyObject_CallMethodOneArg(inbox, S_SINK_FAILED, value ? value : Py_None);
                Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
                if (res == NULL) failed = 1;
                else Py_DECREF(res);
                took = 1;
            }
        }
        Py_XDECREF(native);
        if (!failed && !took && put(inbox, from_string, delta, delta_len) < 0) failed = 1;
        Py_DECREF(inbox);
    }
    PyBuffer_Release(&view);
    if (failed) return NULL;
    Py_RETURN_NONE;
malformed:
    PyBuffer_Release(&view);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a DeltaBatch that does not parse");
    return NULL;
}


/* ---- encode_batch: a worker's turn as DeltaBatch wire bytes ------------------------------------ */

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
} Buffer;

static int buf_reserve(Buffer *b, Py_ssize_t more) {
    return grow((void **)&b->buf, &b->cap, b->len + more, 1);
}

static void put_varint(Buffer *b, uint64_t v) { /* room reserved by the caller (10 bytes) */
    while (v >= 0x80) {
        b->buf[b->len++] = (char)(v | 0x80);
        v >>= 7;
    }
    b->buf[b->len++] = (char)v;
}

static int varint_len(uint64_t v) {
    int n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}

static int put_key_varint(Buffer *b, int field, uint64_t v) {
    if (buf_reserve(b, 20) < 0) return -1;
    put_varint(b, (uint64_t)(field << 3));
    put_varint(b, v);
    return 0;
}

static int put_key_bytes(Buffer *b, int field, const char *s, Py_ssize_t n) {
    if (buf_reserve(b, 20 + n) < 0) return -1;
    put_varint(b, (uint64_t)(field << 3 | 2));
    put_varint(b, (uint64_t)n);
    memcpy(b->buf + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

static PyObject *S_INDEX, *S_TOKEN_OFFSET, *S_TOKEN_IDS, *S_TEXT_OFFSET, *S_TEXT, *S_LOGPROBS, *S_FINISH_REASON,
    *S_STOP_REASON, *S_ERROR, *S_NUM_CACHED;

/* 1: done; 0: not this encoder's (logprobs, an unexpected type or value: the caller encodes it in
 * Python, which refuses what is wrong); -1: an error is set. */
static int encode_uint_attr(Buffer *b, PyObject *d, PyObject *name, int field) {
    PyObject *v = PyObject_GetAttr(d, name);
    if (v == NULL) return -1;
    if (!PyLong_Check(v)) { Py_DECREF(v); return 0; }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    if (x > 0xffffffffULL) return 0;
    if (x && put_key_varint(b, field, x) < 0) return -1;
    return 1;
}

/* A str attribute as field `field`: None and "" are left out unless `always` (a oneof member). */
static int encode_str(Buffer *b, PyObject *v, int field, int always) {
    if (!PyUnicode_Check(v)) return 0;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(v, &n);
    if (s == NULL) { PyErr_Clear(); return 0; } /* lone surrogates: not UTF-8 */
    if ((n || always) && put_key_bytes(b, field, s, n) < 0) return -1;
    return 1;
}

static int encode_str_attr(Buffer *b, PyObject *d, PyObject *name, int field) {
    PyObject *v = PyObject_GetAttr(d, name);
    if (v == NULL) return -1;
    int r = v == Py_None ? 1 : encode_str(b, v, field, 0);
    Py_DECREF(v);
    return r;
}

static int encode_delta(Buffer *b, PyObject *d) {
    int r;
    if ((r = encode_uint_attr(b, d, S_INDEX, 1)) <= 0) return r;
    if ((r = encode_uint_attr(b, d, S_TOKEN_OFFSET, 2)) <= 0) return r;
    PyObject *ids = PyObject_GetAttr(d, S_TOKEN_IDS);
    if (ids == NULL) return -1;
    if (!PyList_Check(ids)) { Py_DECREF(ids); return 0; }
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (n) {
        uint64_t packed[64], *vals = n <= 64 ? packed : PyMem_Malloc((size_t)n * sizeof(uint64_t));
        if (vals == NULL) { Py_DECREF(ids); PyErr_NoMemory(); return -1; }
        Py_ssize_t size = 0;
        r = 1;
        for (Py_ssize_t i = 0; i < n && r == 1; i++) {
            PyObject *item = PyList_GET_ITEM(ids, i);
            long long x = PyLong_Check(item) ? PyLong_AsLongLong(item) : -1;
            if (!PyLong_Check(item) || (x == -1 && PyErr_Occurred()) || x < INT32_MIN || x > INT32_MAX) {
                PyErr_Clear();
                r = 0;
                break;
            }
            vals[i] = (uint64_t)x; /* int32: a negative id is its 64-bit two's complement */
            size += varint_len(vals[i]);
        }
        if (r == 1 && buf_reserve(b, 20 + size) < 0) r = -1;
        if (r == 1) {
            put_varint(b, 3 << 3 | 2);
            put_varint(b, (uint64_t)size);
            for (Py_ssize_t i = 0; i < n; i++) put_varint(b, vals[i]);
        }
        if (vals != packed) PyMem_Free(vals);
        if (r <= 0) { Py_DECREF(ids); return r; }
    }
    Py_DECREF(ids);
    if ((r = encode_uint_attr(b, d, S_TEXT_OFFSET, 4)) <= 0) return r;
    if ((r = encode_str_attr(b, d, S_TEXT, 5)) <= 0) return r;
    PyObject *lps = PyObject_GetAttr(d, S_LOGPROBS);
    if (lps == NULL) return -1;
    int has = lps == Py_None ? 0 : PyObject_IsTrue(lps);
    Py_DECREF(lps);
    if (has != 0) return has < 0 ? -1 : 0;
    if ((r = encode_str_attr(b, d, S_FINISH_REASON, 7)) <= 0) return r;
    PyObject *stop = PyObject_GetAttr(d, S_STOP_REASON);
    if (stop == NULL) return -1;
    r = 1;
    if (PyLong_Check(stop)) {
        long long x = PyLong_AsLongLong(stop);
        if ((x == -1 && PyErr_Occurred()) || x < INT32_MIN || x > INT32_MAX) { PyErr_Clear(); r = 0; }
        else if (put_key_varint(b, 8, (uint64_t)x) < 0) r = -1;
    } else if (stop != Py_None) {
        r = encode_str(b, stop, 9, 1);
    }
    Py_DECREF(stop);
    if (r <= 0) return r;
    if ((r = encode_str_attr(b, d, S_ERROR, 10)) <= 0) return r;
    return encode_uint_attr(b, d, S_NUM_CACHED, 11);
}

static PyObject *encode_batch(PyObject *module, PyObject *items) {
    if (!PyList_Check(items)) {
        PyErr_SetString(PyExc_TypeError, "encode_batch(items: list[tuple[str, SampleDelta]])");
        return NULL;
    }
    Buffer out = {0}, delta = {0};
    PyObject *result = NULL;
    int r = 1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items) && r == 1; i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0))) {
            r = 0;
            break;
        }
        Py_ssize_t rid_len;
        const char *rid = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(pair, 0), &rid_len);
        if (rid == NULL) { PyErr_Clear(); r = 0; break; }
        delta.len = 0;
        if ((r = encode_delta(&delta, PyTuple_GET_ITEM(pair, 1))) <= 0) break;
        Py_ssize_t item = 1 + varint_len((uint64_t)rid_len) + rid_len + 1 + varint_len((uint64_t)delta.len) + delta.len;
        if (buf_reserve(&out, 20 + item) < 0) { r = -1; break; }
        put_varint(&out, 1 << 3 | 2);
        put_varint(&out, (uint64_t)item);
        put_varint(&out, 1 << 3 | 2);
        put_varint(&out, (uint64_t)rid_len);
        memcpy(out.buf + out.len, rid, (size_t)rid_len);
        out.len += rid_len;
        put_varint(&out, 2 << 3 | 2);
        put_varint(&out, (uint64_t)delta.len);
        if (delta.len) memcpy(out.buf + out.len, delta.buf, (size_t)delta.len);
        out.len += delta.len;
    }
    if (r == 1) result = PyBytes_FromStringAndSize(out.buf ? out.buf : "", out.len);
    else if (r == 0) { result = Py_None; Py_INCREF(result); }
    PyMem_Free(out.buf);
    PyMem_Free(delta.buf);
    return result;
}

static PyObject *taken(PyObject *module, PyObject *unused) { return PyLong_FromUnsignedLongLong(TAKEN); }

static PyObject *json_string(PyObject *module, PyObject *arg) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(arg, &n);
    if (s == NULL) return NULL;
    Py_ssize_t len = escaped_len((const uint8_t *)s, n);
    PyObject *out = PyBytes_FromStringAndSize(NULL, len);
    if (out == NULL) return NULL;
    write_escaped(PyBytes_AS_STRING(out), (const uint8_t *)s, n);
    return out;
}

static PyMethodDef module_methods[] = {
    {"dispatch", (PyCFunction)(void (*)(void))dispatch, METH_FASTCALL,
     "dispatch(batch, inboxes, from_string): a DeltaBatch's items to their requests' lanes or inboxes"},
    {"taken", (PyCFunction)taken, METH_NOARGS, "deltas the native lanes of this process took"},
    {"encode_batch", (PyCFunction)encode_batch, METH_O,
     "encode_batch(items): (request id, SampleDelta) pairs as a DeltaBatch's wire bytes; None: one it leaves "
     "to the Python encoder (logprobs, an unexpected value)"},
    {"json_string", (PyCFunction)json_string, METH_O, "a str as the lane writes it: a JSON string literal, UTF-8"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_delta_lane", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__delta_lane(void) {
    if (PyType_Ready(&NativeLaneType) < 0) return NULL;
#define INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(S_DISCONNECTED, "disconnected");
    INTERN(S_RESPONSE_COMPLETE, "response_complete");
    INTERN(S_WRITE_PAUSED, "write_paused");
    INTERN(S_IS_CLOSING, "is_closing");
    INTERN(S_WRITE, "write");
    INTERN(S_NATIVE, "native");
    INTERN(S_PUT, "put");
    INTERN(S_SINK_FAILED, "sink_failed");
    INTERN(S_READY, "ready");
    INTERN(S_INDEX, "index");
    INTERN(S_TOKEN_OFFSET, "token_offset");
    INTERN(S_TOKEN_IDS, "token_ids");
    INTERN(S_TEXT_OFFSET, "text_offset");
    INTERN(S_TEXT, "text");
    INTERN(S_LOGPROBS, "logprobs");
    INTERN(S_FINISH_REASON, "finish_reason");
    INTERN(S_STOP_REASON, "stop_reason");
    INTERN(S_ERROR, "error");
    INTERN(S_NUM_CACHED, "num_cached_tokens");
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&NativeLaneType);
    if (PyModule_AddObject(m, "NativeLane", (PyObject *)&NativeLaneType) < 0) {
        Py_DECREF(&NativeLaneType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
