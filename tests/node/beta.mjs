// openai-node's beta Responses WebSocket client (`openai/resources/beta/responses/ws`), unchanged,
// against a server speaking the responses_multi_agent beta: one response whose tool is
// `async: true` waits at each call; the script injects each output with `response.inject`, and
// steers once with `response.steer` while the response waits on call number `steerAtCall`.
// The plan arrives as JSON in argv[2]; one JSON report goes to stdout; the Python test
// (tests/test_beta.py) makes every assertion.
//
// Plan: { baseURL, model, tools, prompt, steer, steerAtCall, headers, timeoutMs }
import OpenAI from 'openai';
import { ResponsesWS } from 'openai/resources/beta/responses/ws';

const plan = JSON.parse(process.argv[2]);
const client = new OpenAI({ apiKey: 'sk-test', baseURL: plan.baseURL, maxRetries: 0 });
const ws = new ResponsesWS(client, { headers: plan.headers });
const seen = []; // every event, briefly, in arrival order
const events = []; // every event as delivered (the Python test validates each strictly)
const ended = [];
let current = null;
let calls = 0;
let resolveDone;
const done = new Promise((resolve) => { resolveDone = resolve; });

function toolOutput(args) {
  let cmd = '?';
  try { cmd = JSON.parse(args).cmd; } catch { /* reported as is */ }
  return `ran ${cmd}: ok`;
}

ws.on('error', () => {}); // API errors arrive as events too; the report carries them
ws.on('event', (event) => {
  events.push(event);
  seen.push({ type: event.type, sequence_number: event.sequence_number ?? null,
              response_id: event.response?.id ?? event.response_id ?? null, steer: event.steer ?? null,
              error: event.error ?? null });
  if (event.type === 'response.created') {
    current = event.response.id;
  } else if (event.type === 'response.output_item.done' && event.item.type === 'function_call') {
    calls += 1;
    if (calls === plan.steerAtCall) {
      ws.send({ type: 'response.steer', previous_response_id: current, input: plan.steer });
    }
    ws.send({
      type: 'response.inject',
      response_id: current,
      input: [{ type: 'function_call_output', call_id: event.item.call_id, output: toolOutput(event.item.arguments) }],
    });
  } else if (['response.completed', 'response.incomplete', 'response.failed', 'error'].includes(event.type)) {
    ended.push({ type: event.type, id: event.response?.id ?? null, status: event.response?.status ?? null,
                 reason: event.response?.incomplete_details?.reason ?? null,
                 previous_response_id: event.response?.previous_response_id ?? null,
                 last_output: event.response?.output?.at(-1)?.type ?? null });
    if (event.type !== 'response.incomplete') resolveDone();
  }
});

const timer = setTimeout(() => resolveDone(), plan.timeoutMs);
await new Promise((resolve, reject) => {
  ws.socket.on('open', resolve);
  ws.socket.on('error', reject);
});
ws.send({ type: 'response.create', model: plan.model, input: plan.prompt, tools: plan.tools });
await done;
clearTimeout(timer);
ws.close({ code: 1000, reason: 'done' });
process.stdout.write(JSON.stringify({ seen, ended, calls, events }) + '\n');
