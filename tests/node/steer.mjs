// The Vercel AI SDK's steering (`experimental_createSteering`, `steer(message, { interrupt: true })`)
// against longrun, unchanged (tests/clients/test_node_sdks.py runs this). Usage: node steer.mjs BASE_URL
// The steer is client-side: `@ai-sdk/openai` 4.0 has no Responses WebSocket mode, so it never sends
// `response.steer`; an interrupting steer aborts the model call that has produced no output yet and
// makes it again, in the same step, with the message. The steer is sent once the server has
// answered the headers of the second model call (the step after the first tool call) and before the
// SDK reads any of its body. Prints one JSON line: the tool calls the SDK ran, the final text, the
// steer's outcome, and each model call's request (its input) and whether the SDK aborted it.
import { createOpenAI } from '@ai-sdk/openai';
import { experimental_createSteering, stepCountIs, streamText, tool } from 'ai';
import { z } from 'zod';

const [baseURL] = process.argv.slice(2);
const STEER = 'Run the tests of module 4 too.';
const calls = [];
const requests = [];
const steering = experimental_createSteering();
let outcome;

const recordingFetch = async (url, init) => {
  const request = { url: String(url), body: JSON.parse(init.body), aborted: false };
  requests.push(request);
  init.signal?.addEventListener('abort', () => { request.aborted = true; }, { once: true });
  const response = await fetch(url, init);
  if (requests.length === 2) outcome = steering.steer(STEER, { id: 'steer-1', interrupt: true });
  return response;
};

const openai = createOpenAI({ baseURL, apiKey: 'sk-longrun', fetch: recordingFetch });
const execute = async ({ cmd }) => {
  calls.push(cmd);
  return 'ok';
};
const tools = { exec_command: tool({ description: 'Run a shell command.', inputSchema: z.object({ cmd: z.string() }), execute }) };
const result = streamText({
  model: openai.responses('sim'),
  prompt: 'Fix the failing test in module 3.',
  tools,
  stopWhen: stepCountIs(10),
  experimental_steering: steering,
});
const text = await result.text;
const steps = (await result.steps).map((s) => ({ finishReason: s.finishReason, steering: (s.experimental_steeringMessages ?? []).length }));
console.log(JSON.stringify({ calls, text, steps, outcome: await outcome, requests: requests.map((r) => ({ url: r.url, input: r.body.input, aborted: r.aborted })) }));
