// openai-node's agent loops in the modes a user records (`python -m sim record`), unchanged: the
// Python test (tests/sim/record/test_recorder_clients.py) runs each against the server directly
// and through the recorder and compares what the client received.
// The plan arrives as JSON in argv[2]; one JSON report goes to stdout: every event (or whole
// response body) the client received, as delivered, in order.
//
// Plan: { baseURL, flow, prompt, tools, timeoutMs }
// flow: http      (`responses.create({stream: true})`, the whole history each turn)
//       http_prev (the first turn a whole JSON body, then `previous_response_id`, streamed)
//       ws        (`ResponsesWS`: one socket, `previous_response_id` after the first turn)
//       lanes     (`ResponsesWS`: two `stream_id` lanes on one socket, their loops at the same time)
// Every function call is answered with a function_call_output `ok` until the model answers in text.
import OpenAI from 'openai';
import { ResponsesWS } from 'openai/resources/responses/ws';

const plan = JSON.parse(process.argv[2]);
const client = new OpenAI({ apiKey: 'sk-test', baseURL: plan.baseURL, maxRetries: 0 });
const TERMINAL = new Set(['response.completed', 'response.failed', 'response.incomplete', 'error']);
const events = [];

function outputsOf(response) {
  return response.output
    .filter((item) => item.type === 'function_call')
    .map((item) => ({ type: 'function_call_output', call_id: item.call_id, output: 'ok' }));
}

async function streamed(request) {
  const stream = await client.responses.create({ ...request, stream: true });
  let done = null;
  for await (const event of stream) {
    events.push(event);
    if (event.type === 'response.completed') done = event.response;
  }
  if (done === null) throw new Error('the stream ended without response.completed');
  return done;
}

async function httpFlow() {
  let items = [{ role: 'user', content: plan.prompt }];
  for (;;) {
    const done = await streamed({ model: 'sim', input: items, tools: plan.tools });
    const calls = outputsOf(done);
    if (calls.length === 0) return;
    items = [...items, ...done.output, ...calls];
  }
}

async function httpPrevFlow() {
  let response = await client.responses.create({ model: 'sim', input: plan.prompt, tools: plan.tools });
  events.push({ type: 'body', response });
  for (let calls = outputsOf(response); calls.length > 0; calls = outputsOf(response)) {
    response = await streamed({ model: 'sim', input: calls, tools: plan.tools, previous_response_id: response.id });
  }
}

// One socket; `lanes` loops run at once, each on its own `stream_id` (null: no lane named).
async function socketFlow(lanes) {
  const ws = new ResponsesWS(client);
  ws.on('error', () => {}); // API errors arrive as events too; the report carries them
  await new Promise((resolve, reject) => {
    if (ws.socket.readyState === 1) resolve();
    ws.socket.on('open', resolve);
    ws.socket.on('error', reject);
  });
  const waiting = new Map(); // lane -> resolve of its response's terminal event
  ws.on('event', (event) => {
    events.push(event);
    if (TERMINAL.has(event.type)) waiting.get(event.stream_id ?? null)?.(event);
  });
  const loop = async (lane) => {
    const base = { type: 'response.create', model: 'sim', tools: plan.tools, ...(lane === null ? {} : { stream_id: lane }) };
    let request = { ...base, input: lane === null ? plan.prompt : `${plan.prompt} (lane ${lane})` };
    for (;;) {
      const ended = new Promise((resolve) => { waiting.set(lane, resolve); });
      ws.send(request);
      const terminal = await ended;
      if (terminal.type !== 'response.completed') throw new Error(`lane ${lane}: ${JSON.stringify(terminal)}`);
      const calls = outputsOf(terminal.response);
      if (calls.length === 0) return;
      request = { ...base, input: calls, previous_response_id: terminal.response.id };
    }
  };
  await Promise.all(lanes.map(loop));
  ws.close({ code: 1000, reason: 'done' });
}

const flows = {
  http: httpFlow,
  http_prev: httpPrevFlow,
  ws: () => socketFlow([null]),
  lanes: () => socketFlow(['a', 'b']),
};
const timer = setTimeout(() => {
  process.stderr.write(`timed out after ${plan.timeoutMs} ms; events so far: ${JSON.stringify(events.slice(-5))}\n`);
  process.exit(3);
}, plan.timeoutMs);
flows[plan.flow]().then(() => {
  clearTimeout(timer);
  process.stdout.write(JSON.stringify({ events }) + '\n');
}, (error) => {
  process.stderr.write(`${error?.stack ?? error}\n`);
  process.exit(2);
});
