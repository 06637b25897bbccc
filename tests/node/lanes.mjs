// openai-node's ResponsesWebSocketSession against a Responses WebSocket server, unchanged:
// named lanes run concurrent tool loops on one socket and one lane's response is forked onto a
// new lane. The plan arrives as JSON in argv[2]; one JSON report goes to stdout; the Python
// test (tests/test_real_clients_lanes.py) makes every assertion.
//
// Plan: { baseURL, model, tools, store, lanes: [{ id, prompt, turns, final? }],
//         fork?: { from, afterTurn, id, turns, tag }, timeoutMs }
// Each lane answers every function call with a function_call_output and continues with
// previous_response_id and only the new item. The fork is created right after turn `afterTurn`
// of lane `from` completes, continuing that response with a different tool output; as the
// WebSocket-mode guide asks for store=false, the source lane waits for the fork's
// response.in_progress before it advances.
import OpenAI from 'openai';
import { ResponsesWS } from 'openai/resources/responses/ws';
import { ResponsesWebSocketSession } from 'openai/lib/responses/responses-websocket-session';

const TERMINAL = new Set(['response.completed', 'response.failed', 'response.incomplete', 'error']);

const plan = JSON.parse(process.argv[2]);
const client = new OpenAI({ apiKey: 'sk-test', baseURL: plan.baseURL, maxRetries: 0 });
const ws = new ResponsesWS(client);
const raw = []; // every event the socket delivered, in arrival order
ws.on('event', (event) => {
  raw.push(brief(event));
});
ws.on('error', () => {}); // API errors arrive as events too; the report carries them

function toolOutput(tag, turn, args) {
  let cmd = '?';
  try { cmd = JSON.parse(args).cmd; } catch { /* reported as is */ }
  return `$ ${cmd}\nProcess exited with code 0\nOutput:\n${tag} line ${turn}.1\n${tag} line ${turn}.2\n`;
}

function brief(event) {
  return { type: event.type, stream_id: Object.hasOwn(event, 'stream_id') ? event.stream_id : null,
           sequence_number: event.sequence_number ?? null, response_id: event.response?.id ?? null,
           error: event.type === 'error' ? event.error : undefined };
}

// Events of one response from lane.receive(), up to its terminal (or `until`, if given).
async function receiveUntil(lane, events, until) {
  for (;;) {
    const event = await lane.receive();
    events.push(brief(event));
    if (until !== undefined && event.type === until) return event;
    if (TERMINAL.has(event.type)) return event;
  }
}

function summary(response) {
  return { id: response.id, status: response.status, previous_response_id: response.previous_response_id ?? null,
           output: response.output, usage: response.usage };
}

async function runTurn(lane, request, useFinal, hook) {
  lane.create(request);
  const events = [];
  if (hook) {
    const first = await receiveUntil(lane, events, 'response.in_progress');
    if (first.type !== 'response.in_progress') return { events, error: first.type === 'error' ? first : null, response: first.response ? summary(first.response) : null };
    await hook();
  }
  if (useFinal) {
    // The SDK's own accumulator: finalResponse() consumes the rest of this response.
    try {
      return { events: null, response: summary(await lane.finalResponse()) };
    } catch (error) {
      return { events: null, error: { message: String(error?.message ?? error), event: error?.error ?? null } };
    }
  }
  const terminal = await receiveUntil(lane, events);
  if (terminal.type === 'error') return { events, error: terminal };
  return { events, response: summary(terminal.response) };
}

async function runLoop(lane, spec, firstInput, firstPrev, startTurn, onTurn) {
  const turns = [];
  let input = firstInput;
  let prev = firstPrev;
  for (let k = startTurn; k < startTurn + spec.turns; k += 1) {
    const request = { model: plan.model, input, tools: plan.tools, store: plan.store };
    if (prev !== undefined) request.previous_response_id = prev;
    const hook = onTurn?.(k);
    const result = await runTurn(lane, request, spec.final === true, hook?.beforeRest);
    turns.push({ turn: k, input, previous_response_id: prev ?? null, ...result });
    if (!result.response || result.response.status !== 'completed') break;
    const call = result.response.output.at(-1);
    if (!call || call.type !== 'function_call') break;
    const output = { type: 'function_call_output', call_id: call.call_id, output: toolOutput(spec.tag ?? spec.id, k, call.arguments) };
    if (hook?.afterTurn) await hook.afterTurn(result.response, call);
    input = [output];
    prev = result.response.id;
  }
  return turns;
}

async function main() {
  await new Promise((resolve, reject) => {
    if (ws.socket.readyState === 1) resolve();
    ws.socket.on('open', resolve);
    ws.socket.on('error', reject);
  });
  const session = new ResponsesWebSocketSession(ws, { maxLanes: 40, maxBufferedEvents: 100000, maxBufferedBytes: 1 << 28 });
  const fallback = session.lane(); // the default lane: nothing should arrive here
  const unrouted = [];
  const watchDefault = (async () => {
    try { for (;;) unrouted.push(brief(await fallback.receive())); } catch { /* session closed */ }
  })();

  const report = { lanes: {}, fork: null, unrouted, raw };
  const fork = plan.fork;
  let forkDone = Promise.resolve();
  const lanes = plan.lanes.map((spec) => {
    const lane = session.lane(spec.id);
    const first = [{ type: 'message', role: 'user', content: [{ type: 'input_text', text: spec.prompt }] }];
    const onTurn = fork && fork.from === spec.id ? (k) => (k !== fork.afterTurn ? undefined : {
      afterTurn: async (parent, call) => {
        // Fork: a new lane continues this lane's response with its own tool output.
        const forkLane = session.lane(fork.id);
        const forkSpec = { id: fork.id, tag: fork.tag, turns: fork.turns };
        const firstOutput = [{ type: 'function_call_output', call_id: call.call_id, output: toolOutput(fork.tag, k, call.arguments) }];
        let started;
        const inProgress = new Promise((resolve) => { started = resolve; });
        forkDone = runLoop(forkLane, forkSpec, firstOutput, parent.id, k + 1, (j) => (j !== k + 1 ? undefined : {
          beforeRest: async () => { started(); },
        })).then((turns) => { report.fork = { id: fork.id, parent: parent.id, afterTurn: k, turns }; });
        // The guide's barrier for store=false: the source lane advances only after the fork started.
        await Promise.race([inProgress, forkDone]);
      },
    }) : undefined;
    return runLoop(lane, spec, first, undefined, 1, onTurn).then((turns) => { report.lanes[spec.id] = turns; });
  });
  await Promise.all(lanes);
  await forkDone;
  session.close();
  ws.close();
  await watchDefault;
  process.stdout.write(JSON.stringify(report));
}

const timer = setTimeout(() => {
  process.stderr.write(`timed out after ${plan.timeoutMs} ms; events so far: ${JSON.stringify(raw.slice(-20))}\n`);
  process.exit(3);
}, plan.timeoutMs);
main().then(() => { clearTimeout(timer); }, (error) => {
  process.stderr.write(`${error?.stack ?? error}\n`);
  process.exit(2);
});
